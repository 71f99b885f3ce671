"""The agent's HTTP endpoint: liveness, readiness, status and metrics on `[health] listen`.

Handlers only read what the agent already tracks (heartbeats, the current `Health`
snapshot, the metrics registry): a probe never runs `nvidia-imex-ctl`, never waits for
the broker and never blocks, so it is answered as fast as the event loop turns.

The endpoint must keep answering kubelet and systemd probes while misbehaving clients
are connected, so it is bounded on every axis:
- header size: request line, header fields and header count are capped by aiohttp's
  parser (`max_line_size`, `max_field_size`, `max_headers`); longer is a 400;
- body size: only GET is served and a request that carries a body is refused (413)
  and its connection closed, without reading the body;
- request time: a connection must deliver a complete request within
  `request_timeout_s` of connecting or of its previous response (aiohttp's keep-alive
  timer covers both), so idle and byte-at-a-time clients are cut off;
- connections: at most `max_connections` are kept; a new one evicts the connection
  that has been quiet the longest (a slow or idle client, never the newcomer), so a
  probe still gets in while the cap is full of slow clients.

aiohttp's low-level `web.Server` is used rather than an `Application`: four fixed
paths need no router, and its connection hooks are where the cap is enforced.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Self

import msgspec
from aiohttp import web

from imexd import messages
from imexd.errors import FatalError
from imexd.health import Health, Heartbeats
from imexd.logs import get_logger
from imexd.metrics import CONTENT_TYPE, Metrics
from imexd.settings import parse_listen

PATHS: Final = ("/healthz", "/readyz", "/status", "/metrics")

_log = get_logger("http")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLimits:
    """How much any one client may cost the endpoint."""

    max_connections: int = 64
    """Connections kept open at once; beyond it the quietest one is closed."""
    request_timeout_s: float = 5.0
    """Seconds a connection has to deliver a complete request (also the keep-alive
    idle time between requests)."""
    max_line_size: int = 2048
    """Bytes of the request line (the URL); the paths served are short."""
    max_field_size: int = 4096
    """Bytes of one header field."""
    max_headers: int = 32
    """Header fields per request."""
    backlog: int = 128
    """Pending connections the kernel queues before we accept them."""
    shutdown_timeout_s: float = 2.0
    """Seconds a request in flight may take to finish when the server stops."""


@dataclass(slots=True)
class _Conn:
    active: float
    """Loop time of the connection's last request (or of its opening)."""
    closing: bool = False


class _CappedServer(web.Server):
    """aiohttp's low-level server, keeping at most `max_connections` connections."""

    def __init__(self, handler: Any, *, max_connections: int, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._max = max_connections
        self._open: dict[web.RequestHandler, _Conn] = {}

    @property
    def open_connections(self) -> int:
        """Connections open and not being closed."""
        return sum(1 for c in self._open.values() if not c.closing)

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        loop = asyncio.get_running_loop()
        self._open[handler] = _Conn(active=loop.time())
        if self.open_connections <= self._max:
            return
        quiet = [(c.active, h) for h, c in self._open.items() if h is not handler and not c.closing]
        victim = min(quiet, key=lambda item: item[0])[1] if quiet else handler
        self._open[victim].closing = True
        _log.debug("connection evicted", open=self.open_connections + 1, cap=self._max)
        # Closing from inside connection_made would race aiohttp's own setup.
        loop.call_soon(victim.force_close)

    def connection_lost(
        self, handler: web.RequestHandler, exc: BaseException | None = None
    ) -> None:
        self._open.pop(handler, None)
        super().connection_lost(handler, exc)

    def touch(self, handler: web.RequestHandler) -> None:
        """Mark a connection as active: it just delivered a request."""
        conn = self._open.get(handler)
        if conn is not None:
            conn.active = asyncio.get_running_loop().time()


class HealthServer:
    """`/healthz`, `/readyz`, `/status` and `/metrics` over the agent's own state.

    An async context manager: entering binds `listen` (port 0: any free port, see
    `port`) and serves until exit. Binding failures are FatalError: an agent that
    cannot be probed is not a working agent.
    """

    def __init__(
        self,
        listen: str,
        *,
        heartbeats: Heartbeats,
        health: Health,
        metrics: Metrics,
        limits: ServerLimits | None = None,
    ) -> None:
        self._listen = listen
        self._host, self._port = parse_listen(listen)
        self._heartbeats = heartbeats
        self._health = health
        self._metrics = metrics
        self._limits = limits or ServerLimits()
        self._server: _CappedServer | None = None
        self._runner: web.ServerRunner | None = None
        self._site: web.TCPSite | None = None

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The bound port (the real one when `listen` asked for port 0)."""
        return self._site.port if self._site is not None else self._port

    @property
    def url(self) -> str:
        """The base URL that `imexd check --url` takes."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    @property
    def open_connections(self) -> int:
        return self._server.open_connections if self._server is not None else 0

    async def __aenter__(self) -> Self:
        lim = self._limits
        self._server = _CappedServer(
            self._handle,
            max_connections=lim.max_connections,
            keepalive_timeout=lim.request_timeout_s,
            max_line_size=lim.max_line_size,
            max_field_size=lim.max_field_size,
            max_headers=lim.max_headers,
            lingering_time=0,
            access_log=None,
        )
        self._runner = web.ServerRunner(self._server, shutdown_timeout=lim.shutdown_timeout_s)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self._host, self._port, backlog=lim.backlog)
        try:
            await self._site.start()
        except OSError as exc:
            await self._runner.cleanup()
            self._site = None
            raise FatalError(f"cannot listen on {self._listen}: {exc.strerror or exc}") from exc
        _log.info("listening", url=self.url)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = None

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self._server is not None:
            self._server.touch(request.protocol)
        if request.path not in PATHS:
            return _json(404, {"error": f"no such path: {request.path}", "paths": list(PATHS)})
        if request.method != "GET":
            resp = _json(405, {"error": f"{request.method} not allowed: GET only"})
            resp.headers["Allow"] = "GET"
            return resp
        if request.body_exists:
            resp = _json(413, {"error": "requests carry no body here"})
            resp.force_close()
            return resp
        if request.path == "/healthz":
            return self._healthz()
        if request.path == "/readyz":
            return self._readyz()
        if request.path == "/status":
            return web.Response(
                body=messages.encode(self._health.report()),
                content_type="application/json",
                headers=_NO_STORE,
            )
        self._metrics.update_from(self._health.facts, self._health.conditions)
        return web.Response(
            body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE, **_NO_STORE}
        )

    def _healthz(self) -> web.Response:
        stale = self._heartbeats.stale()
        if not stale:
            return _json(200, {"live": True, "tasks": self._heartbeats.names()})
        return _json(
            503,
            {
                "live": False,
                "reason": self._heartbeats.describe(stale),
                "stale": [
                    {
                        "task": name,
                        "age_s": round(age, 3),
                        "interval_s": self._heartbeats.interval(name),
                    }
                    for name, age in stale
                ],
            },
        )

    def _readyz(self) -> web.Response:
        conds = self._health.conditions
        if messages.ready(conds):
            return _json(200, {"ready": True})
        return _json(
            503,
            {
                "ready": False,
                "reason": messages.reason_line(conds),
                "failing": [msgspec.to_builtins(c) for c in messages.failing(conds)],
            },
        )


_NO_STORE: Final = {"Cache-Control": "no-store"}


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps(body, separators=(",", ":")),
        content_type="application/json",
        headers=_NO_STORE,
    )
