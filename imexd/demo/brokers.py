"""The MQTT brokers the demo's agents meet on, and the free ports and addresses they bind.

The demo wraps its Mosquitto (`Mosquitto`, a child process), amqtt and a broker given
with `--broker` in one async context manager shape (`Broker`) so the scenario does not
care which one runs. The tests and the benchmarks start their Mosquitto with the same
launcher, extended with what only they ask of a broker (tests/brokers.py), and take
their ports from `free_port`. Everything here binds 127.0.0.0/8 only, and every wait is
bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from imexd.demo import DemoError
from imexd.settings import parse_broker_url

BROKER_ENV: Final = "IMEXD_DEMO_BROKER"
"""`mosquitto` or `amqtt` forces the embedded broker; unset or `auto`: Mosquitto when
installed, else amqtt."""
BROKER_START_TIMEOUT_S: Final = 10.0
KILL_WAIT_S: Final = 5.0
IMEX_PORTS: Final = (50000, 50005)
"""IMEX's default SERVER_PORT and IMEX_CMD_PORT, used when free on the demo addresses."""
LOG_TAIL_LINES: Final = 6


# Ports, addresses, logs.


EPHEMERAL_FILE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LISTEN_PORTS: Final = (10000, 65535)
"""Where free_port() looks, less the kernel's ephemeral range (PORTS_ENV narrows it)."""
PORTS_ENV: Final = "IMEXD_DEMO_PORTS"
"""`LOW-HIGH`: the ports free_port() may hand out, less the kernel's ephemeral range
(default 10000-65535). Processes that start brokers side by side (test workers) give
each other disjoint ranges, so that no two pick the port one of them left free a moment
(a broker restarting on its port)."""
_handed_out: set[int] = set()
_pick = secrets.SystemRandom()


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default when
    unreadable)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago, for a listener started later.

    Outside the kernel's ephemeral range, so that no outgoing connection takes it before
    its listener binds it, and never the same one twice in this process. (A port the
    kernel picks with bind(0) comes from the ephemeral range: under load a client's
    connection took such a port between the pick and the bind.)
    """
    low, high = ephemeral_ports()
    first, last = listen_ports()
    candidates = [
        r for r in (range(first, min(low, last + 1)), range(max(high + 1, first), last + 1)) if r
    ]
    for _ in range(200):
        span = _pick.choice(candidates) if candidates else None
        if span is None:
            break
        port = _pick.choice(span)
        if port not in _handed_out and _bindable(host, port, reuse=False):
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))  # no room outside the ephemeral range: the kernel's pick
        chosen: int = sock.getsockname()[1]
    _handed_out.add(chosen)
    return chosen


def listen_ports() -> tuple[int, int]:
    """The range free_port() picks from (PORTS_ENV, else _LISTEN_PORTS); DemoError naming
    the variable when it is set wrong."""
    text = os.environ.get(PORTS_ENV, "").strip()
    if not text:
        return _LISTEN_PORTS
    low, _, high = text.partition("-")
    try:
        first, last = int(low), int(high)
    except ValueError:
        first, last = 0, -1
    if not 1024 <= first <= last <= 65535:
        raise DemoError(f"{PORTS_ENV}={text}: expected LOW-HIGH, ports 1024 to 65535, LOW <= HIGH")
    return first, last


def _bindable(address: str, port: int, *, reuse: bool = True) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def pick_addresses(count: int, rand: secrets.SystemRandom) -> tuple[list[str], tuple[int, int]]:
    """`count` loopback addresses 127.A.B.(10+i) and IMEX ports free on all of them.

    A random block keeps concurrent demos apart, B >= 128 keeps them off the blocks the
    scenario tests and the benchmark use (low B). IMEX's own ports are preferred, others
    are tried when something else holds them (a real nvidia-imex on 0.0.0.0).
    """
    for _ in range(40):
        block = f"127.{rand.randrange(10, 250)}.{rand.randrange(128, 254)}"
        addresses = [f"{block}.{10 + i}" for i in range(count)]
        candidates = [IMEX_PORTS, *((p, p + 5) for p in rand.sample(range(20000, 40000), 5))]
        for ports in candidates:
            if all(_bindable(a, p) for a in addresses for p in ports):
                return addresses, ports
    raise DemoError(
        "cannot bind loopback addresses 127.x.y.z other than 127.0.0.1: the simulated nodes "
        "need them (Linux has them; on macOS add aliases with `ifconfig lo0 alias`)"
    )


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, indented and cut to 200 characters, for an error message."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join("      " + (line if len(line) <= 200 else line[:197] + "...") for line in text)


def terminate(proc: subprocess.Popen[Any] | None, *, timeout: float) -> None:
    """A server process ended: SIGTERM (a clean shutdown), then SIGKILL after `timeout`
    seconds; nothing when it is gone already."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def find_mosquitto() -> str | None:
    """The mosquitto binary: on PATH, or where Debian puts it outside a user's PATH."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return "/usr/sbin/mosquitto" if os.access("/usr/sbin/mosquitto", os.X_OK) else None


class Mosquitto:
    """A real Mosquitto on a free port of 127.0.0.1, with a throwaway config in `workdir`
    and no store.

    `stop()` then `start()` restart it on the same port. Synchronous: the demo runs
    `start` and `stop` in a thread. Subclasses add to the configuration through
    `config_lines`.
    """

    def __init__(self, workdir: Path, *, binary: str | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = "127.0.0.1"
        self.port = free_port()
        self.binary = binary
        """The mosquitto binary; None: `find_mosquitto()` when started."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "mosquitto.log"

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def config_lines(self) -> list[str]:
        """The configuration, a directive a line."""
        return [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "max_keepalive 65535",
            "set_tcp_nodelay true",
            # As root Mosquitto drops to the mosquitto user, which cannot read files in
            # private folders (ours are 0700); ignored otherwise.
            "user root",
        ]

    def config_text(self) -> str:
        return "\n".join(self.config_lines()) + "\n"

    def start(self, *, timeout: float = BROKER_START_TIMEOUT_S) -> None:
        """Start it and wait until it listens; DemoError (with its log) when it does not."""
        binary = self.binary or find_mosquitto()
        if binary is None:
            raise DemoError("mosquitto is not installed (e.g. `apt install mosquitto`)")
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(self.config_text())
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [binary, "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DemoError(
                    f"mosquitto exited with status {self.proc.returncode}\n"
                    f"{log_tail(self.log_path)}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise DemoError(
                        f"mosquitto not listening on port {self.port} after {timeout:g} s"
                    ) from None
                time.sleep(0.05)

    def stop(self, *, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        proc, self.proc = self.proc, None
        terminate(proc, timeout=timeout)

    def failure(self) -> str | None:
        """Why it is gone although started; None while it runs (or was stopped)."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"Mosquitto exited with status {self.proc.returncode}\n{log_tail(self.log_path)}"
        return None


# The demo's brokers: one shape for all.


class Broker:
    """An MQTT broker the demo's agents use; an async context manager."""

    url: str = ""
    description: str = ""
    """One line for the header and the summary."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def failure(self) -> str | None:
        """Why the broker is gone while the demo needs it; None while it runs."""
        return None


class ExternalBroker(Broker):
    """The broker named by `--broker`: used as is, never started nor stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.description = f"{url} (given with --broker)"

    async def __aenter__(self) -> Self:
        """Fail at once when nothing listens there, not after the formation timeout."""
        target = parse_broker_url(self.url)
        try:
            async with asyncio.timeout(BROKER_START_TIMEOUT_S):
                if target.scheme == "unix":
                    _, writer = await asyncio.open_unix_connection(target.path)
                else:
                    _, writer = await asyncio.open_connection(target.host, target.port)
        except (OSError, TimeoutError) as exc:
            raise DemoError(f"cannot reach the broker {self.url}: {exc or 'timed out'}") from None
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return self


class MosquittoBroker(Broker):
    """The `Mosquitto` launcher as the demo's broker, started in a thread."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.server = Mosquitto(folder, binary=binary)

    @property
    def pid(self) -> int | None:
        return self.server.proc.pid if self.server.proc is not None else None

    async def __aenter__(self) -> Self:
        problem = ""
        for _ in range(3):  # the free port can be taken between the probe and the bind
            try:
                await asyncio.to_thread(self.server.start, timeout=BROKER_START_TIMEOUT_S)
            except DemoError as exc:
                problem = str(exc)
                self.server.port = free_port()
                continue
            self.url = self.server.url
            self.description = f"Mosquitto ({self.server.binary}) at {self.url}, MQTT 5"
            return self
        raise DemoError(f"Mosquitto did not start: {problem}")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.server.stop, timeout=KILL_WAIT_S)

    def failure(self) -> str | None:
        return self.server.failure()


class AmqttBroker(Broker):
    """amqtt, a pure-Python MQTT 3.1.1 broker, inside this process (the `demo` extra).

    amqtt cannot parse an MQTT 5 CONNECT that carries properties: it waits for bytes
    that never come, where the 3.1.1 spec requires the answer "unacceptable protocol
    version". imexd's bus tries MQTT 5 first and falls back to 3.1.1 on that answer, so
    the demo's listener reads each CONNECT's protocol level first, gives that answer to
    MQTT 5 itself and hands every other connection to amqtt untouched. With 3.1.1 the
    agents' wills fire at once instead of after the Will Delay.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.log_path = folder / "amqtt.log"
        self._broker: Any = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._log_handler: logging.Handler | None = None
        self._previous_handler: Any = None

    async def __aenter__(self) -> Self:
        try:
            from amqtt.broker import Broker as Amqtt  # noqa: PLC0415 - optional dependency
        except ImportError:
            raise DemoError(
                "no MQTT broker: install Mosquitto (e.g. `apt install mosquitto`), or the "
                "demo extra for the built-in one (`pip install 'imexd[demo]'`), or pass "
                "--broker mqtt://HOST:PORT"
            ) from None
        self.folder.mkdir(parents=True, exist_ok=True)
        self._quiet_logs()
        config = {
            "listeners": {"default": {"type": "external"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}
            },
        }
        try:
            self._broker = Amqtt(config)
            await self._broker.start()
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        except Exception as exc:
            await self._close()
            raise DemoError(f"the amqtt broker did not start: {exc}") from None
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"mqtt://127.0.0.1:{port}"
        self.description = f"amqtt (Python, in this process) at {self.url}, MQTT 3.1.1"
        return self

    def _quiet_logs(self) -> None:
        """amqtt and its state machine log to a file in the folder, not over the table."""
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self._log_handler = handler
        for name in ("amqtt", "transitions"):
            logger = logging.getLogger(name)
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
        loop = asyncio.get_running_loop()
        self._previous_handler = loop.get_exception_handler()

        def to_file(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            logging.getLogger("amqtt.demo").error("%s", context.get("message"), exc_info=None)

        loop.set_exception_handler(to_file)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except Exception:  # amqtt's own failures stay in its log, never on the demo's screen
            logging.getLogger("amqtt.demo").exception("connection failed")
        finally:
            writer.close()
            if task is not None:
                self._connections.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from amqtt.adapters import StreamWriterAdapter  # noqa: PLC0415 - optional dependency

        async with asyncio.timeout(10):
            head = await reader.readexactly(1)
            for _ in range(4):  # the Remaining Length, 1 to 4 bytes
                head += await reader.readexactly(1)
                if head[-1] < 0x80:
                    break
            size = await reader.readexactly(2)
            name = await reader.readexactly(min(int.from_bytes(size, "big"), 6))
            level = await reader.readexactly(1)
        head += size + name + level
        if head[0] >> 4 == 1 and name == b"MQTT" and level[0] >= 5:
            writer.write(b"\x20\x02\x00\x01")  # CONNACK: unacceptable protocol version
            await writer.drain()
            return
        await self._broker.external_connected(
            _ReplayReader(head, reader), StreamWriterAdapter(writer), "default"
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._broker is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(KILL_WAIT_S):
                    await self._broker.shutdown()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(self._connections, timeout=KILL_WAIT_S)
        if self._log_handler is not None:
            for name in ("amqtt", "transitions"):
                logging.getLogger(name).removeHandler(self._log_handler)
            self._log_handler.close()
            asyncio.get_running_loop().set_exception_handler(self._previous_handler)
            self._log_handler = None


class _ReplayReader:
    """amqtt's ReaderAdapter over a stream whose first bytes were already read."""

    def __init__(self, head: bytes, reader: asyncio.StreamReader) -> None:
        self._head = head
        self._reader = reader

    async def read(self, n: int = -1) -> bytes:
        if n < 0:
            data, self._head = self._head + await self._reader.read(), b""
            return data
        data, self._head = self._head[:n], self._head[n:]
        if len(data) < n:
            data += await self._reader.readexactly(n - len(data))
        return data

    def feed_eof(self) -> None:
        self._reader.feed_eof()


def choose_broker(env: Mapping[str, str], folder: Path, mosquitto: str | None) -> Broker:
    """The embedded broker: `IMEXD_DEMO_BROKER` if set, else Mosquitto when installed
    (`mosquitto`: its binary, or None), else amqtt."""
    wanted = env.get(BROKER_ENV, "").strip().lower() or "auto"
    if wanted not in ("auto", "mosquitto", "amqtt"):
        raise DemoError(f"{BROKER_ENV}={wanted}: expected mosquitto, amqtt or auto")
    if mosquitto is not None and wanted != "amqtt":
        return MosquittoBroker(mosquitto, folder)
    if wanted == "mosquitto":
        raise DemoError(f"{BROKER_ENV}=mosquitto, but no mosquitto binary is installed")
    return AmqttBroker(folder)
