"""nats-server for the tests and benchmarks: one server with JetStream and its MQTT
listener (`Nats`), or a cluster of them (`NatsCluster`), on free ports of 127.0.0.1.

Here, not in the shipped package, because the demo never runs NATS: only the NATS tests
(tests/test_nats.py, tests/test_resync.py, tests/test_client_id.py) and bench/ do. It
borrows the demo's port and process helpers (imexd.demo.brokers). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Final

from imexd.bus.mqtt import Client, connect
from imexd.demo import DemoError
from imexd.demo.brokers import KILL_WAIT_S, free_port, log_tail, terminate
from imexd.errors import BusError
from imexd.names import client_id
from imexd.settings import BusSettings, parse_broker_url

NATS_START_TIMEOUT_S: Final = 30.0
"""Bound on a NATS server (or cluster) becoming MQTT-ready: a JetStream cluster first
elects its meta leader and creates the MQTT streams, seconds on a loaded machine."""
NATS_CLUSTER_NAME: Final = "imexd"


def find_nats_server() -> str | None:
    """The nats-server binary: on PATH, or where Debian puts it outside a user's PATH."""
    found = shutil.which("nats-server")
    if found:
        return found
    return "/usr/sbin/nats-server" if os.access("/usr/sbin/nats-server", os.X_OK) else None


def mqtt_connect_problem(host: str, port: int, *, timeout: float = 2.0) -> str | None:
    """None when an MQTT 3.1.1 CONNECT (clean session) to host:port is accepted; else
    what went wrong. A NATS server accepts TCP before its MQTT streams exist, so a listening
    port alone does not mean that a client can connect."""
    identifier = client_id("imexd-probe", secrets.token_hex(4)).encode()
    variable = b"\x00\x04MQTT\x04\x02\x00\x0a"  # protocol name and level 4, clean session, 10 s
    body = variable + len(identifier).to_bytes(2, "big") + identifier
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(bytes([0x10, len(body)]) + body)
            answer = b""
            while len(answer) < 4:
                chunk = sock.recv(4 - len(answer))
                if not chunk:
                    return "closed before CONNACK"
                answer += chunk
            with contextlib.suppress(OSError):
                sock.sendall(b"\xe0\x00")  # DISCONNECT
    except OSError as exc:
        return str(exc) or type(exc).__name__
    if answer[0] != 0x20 or answer[3] != 0:
        return f"CONNACK {answer.hex()}"
    return None


class Nats:
    """One nats-server on free ports of 127.0.0.1: JetStream (its store in `workdir`) and
    an MQTT listener, optionally a member of a cluster (`NatsCluster` builds those).

    `stop()` or `kill()` then `start()` bring it back on the same ports with the same
    store, so the retained messages (a JetStream stream) survive. nats-server speaks MQTT
    3.1.1 only: agents fall back to it, or are told `[bus] protocol = "3.1.1"`.
    """

    protocol: Final = "3.1.1"
    """The MQTT version it speaks: the `[bus] protocol` its clients should use."""

    def __init__(
        self,
        workdir: Path,
        *,
        name: str = "nats-1",
        binary: str | None = None,
        cluster_port: int | None = None,
        routes: tuple[int, ...] = (),
        stream_replicas: int | None = None,
        consumer_replicas: int | None = None,
    ) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        """`server_name`: JetStream needs one, unique within the cluster."""
        self.host = "127.0.0.1"
        self.port = free_port()
        """The MQTT port."""
        self.client_port = free_port()
        """The NATS client port (nats-server always opens one)."""
        self.monitor_port = free_port()
        """The HTTP monitoring port: `/healthz` says whether JetStream is current."""
        self.cluster_port = cluster_port
        self.routes = routes
        """Cluster ports of every server of the cluster (its own one is ignored)."""
        self.stream_replicas = stream_replicas
        """Replicas of the MQTT streams (sessions, messages, retained); None: one."""
        self.consumer_replicas = consumer_replicas
        """Replicas of the consumer behind each QoS 1 subscription, held in memory; None:
        nats-server's default (the streams' replicas, on disk). nats-server 2.9.12 and later
        ignore the count (logged as a warning) and give each the streams' replicas."""
        self.binary = binary
        """The nats-server binary; None: `find_nats_server()` when started."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def urls(self) -> list[str]:
        return [self.url]

    def config_text(self) -> str:
        lines = [
            f"server_name: {self.name}",
            f"listen: {self.host}:{self.client_port}",
            f"http: {self.host}:{self.monitor_port}",
            f'jetstream {{ store_dir: "{self.workdir / "jetstream"}" }}',
            "mqtt {",
            f"  listen: {self.host}:{self.port}",
        ]
        if self.stream_replicas is not None:
            lines.append(f"  stream_replicas: {self.stream_replicas}")
        if self.consumer_replicas is not None:
            lines.append(f"  consumer_replicas: {self.consumer_replicas}")
            lines.append("  consumer_memory_storage: true")
        lines.append("}")
        if self.cluster_port is not None:
            routes = ", ".join(f"nats-route://{self.host}:{p}" for p in self.routes)
            lines += [
                "cluster {",
                f"  name: {NATS_CLUSTER_NAME}",
                f"  listen: {self.host}:{self.cluster_port}",
                f"  routes: [{routes}]",
                "}",
            ]
        return "\n".join(lines) + "\n"

    def launch(self) -> None:
        """Start the process and return at once (`start` also waits until it serves)."""
        binary = self.binary or find_nats_server()
        if binary is None:
            raise DemoError("nats-server is not installed (e.g. `apt install nats-server`)")
        if self.alive():
            raise DemoError(f"nats-server {self.name} already runs (pid {self.pid})")
        conf = self.workdir / "nats-server.conf"
        conf.write_text(self.config_text())
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [binary, "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        """Wait (until the monotonic `deadline`) until an MQTT CONNECT is accepted."""
        while True:
            if failure := self.failure():
                raise DemoError(failure)
            problem = mqtt_connect_problem(self.host, self.port) or ""
            if not problem:
                return
            if time.monotonic() > deadline:
                raise DemoError(
                    f"nats-server {self.name} does not accept MQTT on port {self.port}: "
                    f"{problem}\n{log_tail(self.log_path)}"
                )
            time.sleep(0.1)

    def health_problem(self) -> str:
        """What nats-server's `/healthz` says is wrong ("" when it says ok): on a cluster
        member, whether its JetStream is current with the meta leader and its streams and
        consumers have caught up (a restarted server that has not, counts as missing
        from every quorum)."""
        url = f"http://{self.host}:{self.monitor_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as answer:
                body = answer.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        except OSError as exc:
            return f"{url}: {exc}"
        try:
            verdict = json.loads(body)
        except ValueError:
            return f"{url}: not JSON: {body[:200]!r}"
        if isinstance(verdict, dict) and verdict.get("status") == "ok":
            return ""
        return f"{url}: {verdict}"

    def retained_feeds(self) -> tuple[set[str], set[str]]:
        """(the feeds this server holds, the feed it reads), each named by its deliver
        subject. Each server of a cluster fills its retained map from one `$MQTT_rmsgs`
        consumer (its feed) delivered to a subscription of its own; nats-server 2.10.11
        and later make that consumer ephemeral, with one replica, held by any server of
        the cluster. From its monitoring endpoint (`/jsz`, `/subsz`)."""
        report = self._monitor("jsz?accounts=true&consumers=true&config=true")
        held = {
            str((consumer.get("config") or {}).get("deliver_subject"))
            for account in report.get("account_details") or []
            for stream in account.get("stream_detail") or []
            if stream.get("name") == "$MQTT_rmsgs"
            for consumer in stream.get("consumer_detail") or []
            if (consumer.get("cluster") or {}).get("leader") == self.name
        }
        subs = self._monitor("subsz?subs=1&limit=100000").get("subscriptions_list") or []
        reads = {str(sub.get("subject")) for sub in subs}
        return held, {s for s in reads if s.startswith("$MQTT.sub.")}

    def retained_stored(self) -> int:
        """The last sequence of the `$MQTT_rmsgs` stream (the retained store) as this
        server reports it (`/jsz`); 0 when it reports none."""
        report = self._monitor("jsz?accounts=true&streams=true")
        return max(
            (
                int((stream.get("state") or {}).get("last_seq") or 0)
                for account in report.get("account_details") or []
                for stream in account.get("stream_detail") or []
                if stream.get("name") == "$MQTT_rmsgs"
            ),
            default=0,
        )

    def _monitor(self, query: str) -> dict[str, Any]:
        url = f"http://{self.host}:{self.monitor_port}/{query}"
        with urllib.request.urlopen(url, timeout=5.0) as answer:
            report: dict[str, Any] = json.load(answer)
        return report

    def start(self, *, timeout: float = NATS_START_TIMEOUT_S) -> None:
        """Start it and wait until it accepts MQTT clients; DemoError (with its log) when
        it does not within `timeout` seconds (it is stopped then)."""
        self.launch()
        try:
            self.wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.stop()  # no server outlives a failed start
            raise

    def restart(self, *, timeout: float = NATS_START_TIMEOUT_S) -> None:
        self.stop()
        self.start(timeout=timeout)

    def stop(self, *, timeout: float = 10.0) -> None:
        """SIGTERM (nats-server shuts down cleanly), then SIGKILL after `timeout` seconds."""
        proc, self.proc = self.proc, None
        terminate(proc, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash (no clean shutdown of its store)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(timeout=KILL_WAIT_S)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def failure(self) -> str | None:
        """Why it is gone although started; None while it runs (or was stopped)."""
        if self.proc is not None and self.proc.poll() is not None:
            return (
                f"nats-server {self.name} exited with status {self.proc.returncode}\n"
                f"{log_tail(self.log_path)}"
            )
        return None


class NatsCluster:
    """`size` nats-servers routed to each other (a JetStream cluster), each with its own
    MQTT listener; the MQTT streams are replicated on `min(size, 3)` servers, so the
    retained state survives the loss of any one server of three.

    `servers[i]` is each `Nats` (stop, kill and start them one by one); `urls` are their
    MQTT URLs, for `[bus] url`. `start()` returns once every server accepts MQTT and a
    retained message published through one is read through each other one.
    """

    protocol: Final = "3.1.1"

    def __init__(
        self,
        workdir: Path,
        *,
        size: int = 3,
        binary: str | None = None,
        consumer_replicas: int | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"a NATS cluster needs at least one server, not {size}")
        self.workdir = workdir
        cluster_ports = tuple(free_port() for _ in range(size))
        self.servers = [
            Nats(
                workdir / f"nats-{i + 1}",
                name=f"nats-{i + 1}",
                binary=binary,
                cluster_port=port,
                routes=cluster_ports,
                stream_replicas=min(size, 3),
                consumer_replicas=consumer_replicas,
            )
            for i, port in enumerate(cluster_ports)
        ]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def host(self) -> str:
        return self.servers[0].host

    @property
    def port(self) -> int:
        return self.servers[0].port

    def start(self, *, timeout: float = NATS_START_TIMEOUT_S) -> None:
        """Start every server not running and wait until the cluster serves MQTT."""
        deadline = time.monotonic() + timeout
        try:
            for server in self.servers:
                if not server.alive():
                    server.launch()
            self.wait_ready(deadline)
        except BaseException:
            self.stop()  # no server outlives a failed start
            raise

    def wait_ready(self, deadline: float) -> None:
        """Wait until every running server accepts MQTT, retained messages flow between
        them (the JetStream meta leader is elected, the streams are placed) and each says
        it is healthy (current with the meta leader: a server killed after this leaves a
        quorum behind)."""
        running = [s for s in self.servers if s.alive()]
        for server in running:
            server.wait_ready(deadline)
        retained_flow(running, deadline)
        for server in running:
            while problem := server.health_problem():
                if time.monotonic() > deadline:
                    raise DemoError(f"nats-server {server.name} is not healthy: {problem}")
                time.sleep(0.2)

    def stop(self, *, timeout: float = 10.0) -> None:
        for server in self.servers:
            server.stop(timeout=timeout)

    def kill(self) -> None:
        for server in self.servers:
            server.kill()

    def failure(self) -> str | None:
        return next((f for s in self.servers if (f := s.failure())), None)


def retained_flow(servers: list[Nats], deadline: float) -> None:
    """Publish a retained message through the first server and wait (until the monotonic
    `deadline`) until each other server delivers it to a new subscriber; then clear it.
    DemoError naming the server that never did. Synchronous (it runs its own event loop):
    call it from a thread when a loop runs."""
    if len(servers) < 2:
        return
    topic = f"imexd-ready/{secrets.token_hex(6)}"
    payload = secrets.token_hex(8).encode()
    first = servers[0]
    for server in servers[1:]:
        while problem := asyncio.run(_retained_problem(first, server, topic, payload)):
            if failure := server.failure() or first.failure():
                raise DemoError(failure)
            if time.monotonic() > deadline:
                raise DemoError(
                    f"a retained message published through nats-server {first.name} does not "
                    f"reach {server.name}: {problem}\n{log_tail(server.log_path)}"
                )
            time.sleep(0.2)
    # Clearing the marker is tidiness: a slow acknowledgement must not fail the start.
    with contextlib.suppress(BusError, TimeoutError, OSError):
        asyncio.run(publish_retained(first, topic, b"", wait_s=10.0))


async def publish_retained(
    server: Nats, topic: str, payload: bytes, *, wait_s: float = 2.0
) -> None:
    client = await _connect(server, wait_s)
    try:
        await client.publish(topic, payload, retain=True)
    finally:
        await client.close(wait_s)


async def retained_copy(server: Nats, topic: str, *, wait_s: float = 2.0) -> bytes | None:
    """The retained message on `topic` that a new subscription through `server` gets
    within `wait_s`, None when none comes (or the server cannot be reached)."""
    try:
        client = await _connect(server, wait_s)
    except BusError:
        return None
    try:
        async with asyncio.timeout(wait_s):
            (refusal,) = await client.subscribe([topic], qos=0)
            if refusal is not None:
                return None
            async for message in client.messages():
                if message.retained:
                    return message.payload
    except (BusError, TimeoutError):
        return None
    finally:
        await client.close(wait_s)
    return None


async def _retained_problem(first: Nats, other: Nats, topic: str, payload: bytes) -> str:
    """Publish `payload` retained through `first` and read it back through `other`; what
    went wrong, or the empty string."""
    try:
        await publish_retained(first, topic, payload)
        client = await _connect(other, 2.0)
        try:
            async with asyncio.timeout(2.0):
                refusals = await client.subscribe([topic])
                if refusals[0] is not None:
                    return f"subscription refused (code {refusals[0]})"
                async for message in client.messages():
                    if message.retained and message.payload == payload:
                        return ""
        finally:
            await client.close(2.0)
    except (BusError, TimeoutError, OSError) as exc:
        return str(exc) or type(exc).__name__
    return "no message"


async def _connect(server: Nats, wait_s: float) -> Client:
    """A clean-session MQTT 3.1.1 client of `server` with a fresh client id."""
    settings = BusSettings(url=(server.url,), protocol="3.1.1")
    return await connect(
        settings,
        parse_broker_url(server.url),
        client_id=client_id("imexd-ready", secrets.token_hex(4)),
        timeout_s=wait_s,
        connect_timeout_s=wait_s,
    )
