"""The agent's HTTP endpoint: liveness, readiness, status and metrics on `[health] listen`.

Handlers only read what the agent already tracks (heartbeats, the current `Health`
snapshot, the metrics registry): a probe never runs `nvidia-imex-ctl`, never waits for
the broker and never blocks, so it is answered as fast as the event loop turns.

The endpoint must keep answering kubelet and systemd probes while misbehaving clients
are connected, so it is bounded on every axis:
- header size: the request line, each header field and the header count are capped
  (`max_line_size`, `max_field_size`, `max_headers`); longer is a 4xx and a close;
- body size: only GET is served and a request that carries a body is refused (413)
  and its connection closed, without reading the body;
- request time: a connection must deliver a complete request head within
  `request_timeout_s` of connecting or of its previous response, and take each answer
  within as long, so idle, byte-at-a-time and never-reading clients are cut off;
- connections: at most `max_connections` are kept; a new one evicts the connection
  that has been quiet the longest (a slow or idle client, never the newcomer), so a
  probe still gets in while the cap is full of slow clients.

HTTP/1.1 over asyncio streams, written here: four fixed GET paths with no body need a
request line, header fields and a response, not a web framework: aiohttp's server cost
the agent much of its memory (docs/performance.md, issue 22).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
from types import TracebackType
from typing import Any, Final, Self

import msgspec

from imexd import messages
from imexd.errors import FatalError
from imexd.health.conditions import Health, Heartbeats
from imexd.health.metrics import CONTENT_TYPE, Metrics
from imexd.logs import get_logger
from imexd.settings import parse_listen

PATHS: Final = ("/healthz", "/readyz", "/status", "/metrics")

_log = get_logger("http")


REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Request Entity Too Large",
    414: "Request-URI Too Long",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}
"""The reason phrase of each status the server answers with, as http.HTTPStatus words
it: the agent need not hold that module's table of every status for these eight."""


class ServerLimits(msgspec.Struct, frozen=True, kw_only=True):
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


class _Conn(msgspec.Struct, eq=False):
    writer: asyncio.StreamWriter
    task: asyncio.Task[None] | None
    active: float
    """Loop time of the connection's last request (or of its opening)."""
    closing: bool = False


class _Request(msgspec.Struct, frozen=True):
    method: str
    path: str
    keep_alive: bool
    has_body: bool


class _Response(msgspec.Struct, frozen=True):
    status: int
    body: bytes
    content_type: str = "application/json"
    extra: tuple[tuple[str, str], ...] = ()
    close: bool = False


class _RefusedError(Exception):
    """The request head broke a limit or HTTP's syntax: answer `status` and close."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


_CHANGE: Final = "set [health] listen (IMEXD_HEALTH_LISTEN) to"
_BIND_ADVICE: Final = {
    errno.EADDRINUSE: "another process holds the port (a second agent?): stop it, or "
    f"{_CHANGE} a free HOST:PORT",
    errno.EADDRNOTAVAIL: f"not an address of this host: {_CHANGE} one of its addresses",
    errno.EACCES: f"a port below 1024 needs CAP_NET_BIND_SERVICE: {_CHANGE} a higher port",
}


def _bind_advice(exc: OSError) -> str:
    """Why `[health] listen` cannot be bound, and the setting to change, on one line.

    asyncio's bind error repeats the address in its `strerror`: the errno's own text is
    shorter, and the address is already in the caller's message."""
    code = exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else None
    why = os.strerror(code) if code is not None else exc.strerror or str(exc)
    advice = _BIND_ADVICE.get(code or 0, f"{_CHANGE} HOST:PORT of this host")
    return f"{why}: {advice}"


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
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The bound port (the real one when `listen` asked for port 0)."""
        if self._server is not None and self._server.sockets:
            return int(self._server.sockets[0].getsockname()[1])
        return self._port

    @property
    def url(self) -> str:
        """The base URL that `imexd check --url` takes."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    @property
    def open_connections(self) -> int:
        """Connections open and not being closed."""
        return sum(1 for c in self._conns if not c.closing)

    async def __aenter__(self) -> Self:
        lim = self._limits
        try:
            self._server = await asyncio.start_server(
                self._serve,
                self._host,
                self._port,
                backlog=lim.backlog,
                # readline() refuses a longer line (ValueError): the caps hold unread.
                limit=max(lim.max_line_size, lim.max_field_size) + 2,
            )
        except OSError as exc:
            raise FatalError(f"cannot listen on {self._listen}: {_bind_advice(exc)}") from exc
        _log.info("listening", url=self.url)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for conn in self._conns:
            conn.writer.close()
        tasks = [c.task for c in self._conns if c.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self._limits.shutdown_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        conn = _Conn(writer=writer, task=asyncio.current_task(), active=loop.time())
        self._conns.add(conn)
        self._evict(conn)
        try:
            while not conn.closing:
                try:
                    async with asyncio.timeout(self._limits.request_timeout_s):
                        request = await self._read_head(reader)
                except _RefusedError as refused:
                    await self._send(
                        writer,
                        _json_response(refused.status, {"error": str(refused)}, close=True),
                        keep_alive=False,
                    )
                    return
                if request is None:
                    return
                conn.active = loop.time()
                response = self._respond(request)
                keep = request.keep_alive and not response.close
                await self._send(writer, response, keep_alive=keep)
                if not keep:
                    return
        except (TimeoutError, OSError):
            return
        finally:
            self._conns.discard(conn)
            writer.close()

    def _evict(self, newcomer: _Conn) -> None:
        """Past the cap, close the connection quiet the longest (never the newcomer)."""
        if self.open_connections <= self._limits.max_connections:
            return
        quiet = [c for c in self._conns if c is not newcomer and not c.closing]
        victim = min(quiet, key=lambda c: c.active) if quiet else newcomer
        victim.closing = True
        _log.debug(
            "connection evicted", open=self.open_connections + 1, cap=self._limits.max_connections
        )
        victim.writer.close()

    async def _read_head(self, reader: asyncio.StreamReader) -> _Request | None:
        """The next request's head, or None when the client closed between requests."""
        lim = self._limits
        try:
            line = await reader.readline()
        except ValueError:
            raise _RefusedError(414, "request line too long") from None
        if not line.endswith(b"\n"):
            return None  # closed, maybe mid-line: nothing to answer
        if len(line) > lim.max_line_size:
            raise _RefusedError(414, "request line too long")
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _RefusedError(400, "malformed request line")
        method, target, version = parts
        headers: dict[str, str] = {}
        count = 0
        while True:
            try:
                field = await reader.readline()
            except ValueError:
                raise _RefusedError(431, "header field too long") from None
            if not field.endswith(b"\n"):
                return None
            if field in (b"\r\n", b"\n"):
                break
            count += 1
            if count > lim.max_headers:
                raise _RefusedError(431, "too many header fields")
            if len(field) > lim.max_field_size:
                raise _RefusedError(431, "header field too long")
            name, sep, value = field.decode("latin-1").partition(":")
            if not sep or not name or name != name.strip():
                raise _RefusedError(400, "malformed header field")
            headers[name.lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
        length = headers.get("content-length", "0").strip() or "0"
        has_body = "transfer-encoding" in headers or length != "0"
        return _Request(method, target.split("?", 1)[0], keep_alive, has_body)

    async def _send(
        self, writer: asyncio.StreamWriter, response: _Response, *, keep_alive: bool
    ) -> None:
        """Write the answer, waiting at most the request timeout for the client to take
        it: one that never reads its answers holds no connection for long."""
        head = [
            f"HTTP/1.1 {response.status} {REASONS[response.status]}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            "Cache-Control: no-store",
            *(f"{k}: {v}" for k, v in response.extra),
        ]
        if not keep_alive:
            head.append("Connection: close")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body)
        async with asyncio.timeout(self._limits.request_timeout_s):
            await writer.drain()

    def _respond(self, request: _Request) -> _Response:
        if request.path not in PATHS:
            return _json_response(
                404, {"error": f"no such path: {request.path}", "paths": list(PATHS)}
            )
        if request.method != "GET":
            return _json_response(
                405, {"error": f"{request.method} not allowed: GET only"}, extra=(("Allow", "GET"),)
            )
        if request.has_body:
            return _json_response(413, {"error": "requests carry no body here"}, close=True)
        if request.path == "/healthz":
            return self._healthz()
        if request.path == "/readyz":
            return self._readyz()
        if request.path == "/status":
            return _Response(200, messages.encode(self._health.report()))
        self._metrics.update_from(self._health.facts, self._health.conditions)
        return _Response(200, self._metrics.render(), content_type=CONTENT_TYPE)

    def _healthz(self) -> _Response:
        stale = self._heartbeats.stale()
        if not stale:
            return _json_response(200, {"live": True, "tasks": self._heartbeats.names()})
        return _json_response(
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

    def _readyz(self) -> _Response:
        conds = self._health.conditions
        if messages.ready(conds):
            return _json_response(200, {"ready": True})
        return _json_response(
            503,
            {
                "ready": False,
                "reason": messages.reason_line(conds),
                "failing": [msgspec.to_builtins(c) for c in messages.failing(conds)],
            },
        )


def _json_response(
    status: int,
    body: dict[str, Any],
    *,
    extra: tuple[tuple[str, str], ...] = (),
    close: bool = False,
) -> _Response:
    return _Response(
        status, json.dumps(body, separators=(",", ":")).encode(), extra=extra, close=close
    )
