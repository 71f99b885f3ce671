"""The HTTP endpoint against a real server on a free loopback port, and the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from msgspec.structs import replace
from prometheus_client.parser import text_string_to_metric_families

from imexd import messages
from imexd.errors import FatalError
from imexd.facts import (
    BusFacts,
    DaemonFacts,
    Facts,
    LinkFacts,
    Member,
    MembershipFacts,
    SlotLink,
)
from imexd.health import conditions as health
from imexd.health.conditions import Health, Heartbeats
from imexd.health.http import HealthServer, ServerLimits
from imexd.health.metrics import CONTENT_TYPE, Metrics
from imexd.messages import HealthReport
from tests.support import until

MEMBERS = {0: Member("n1", "127.0.0.1"), 1: Member("n2", "127.0.0.2")}
READY = Facts(
    node="n1",
    domain="d1",
    clique="c0ffee.1",
    address="127.0.0.1",
    slot=0,
    incarnation=2,
    bus=BusFacts(connected=True, synced=True, broker="mqtt://127.0.0.1:1883"),
    membership=MembershipFacts(state="member", members=MEMBERS),
    daemon=DaemonFacts(state="RUNNING", pid=99, restarts=2, reloads=5, imex_status="READY"),
    domain_probe=LinkFacts(slots={s: SlotLink(m.node, "READY", True) for s, m in MEMBERS.items()}),
)


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Agent:
    """The state an agent would hand to its HealthServer, driven by the test."""

    clock: FakeClock
    heartbeats: Heartbeats
    health: Health
    metrics: Metrics
    server: HealthServer


@contextlib.asynccontextmanager
async def serving(facts: Facts, limits: ServerLimits | None = None) -> AsyncIterator[Agent]:
    clock = FakeClock()
    beats = Heartbeats(clock=clock)
    beats.register("main", 1.0)
    beats.register("bus", 10.0)
    state = Health(facts)
    metrics = Metrics()
    server = HealthServer(
        "127.0.0.1:0", heartbeats=beats, health=state, metrics=metrics, limits=limits
    )
    async with server:
        yield Agent(clock, beats, state, metrics, server)


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    """A ready agent's endpoint on a free port."""
    async with serving(READY) as a:
        yield a


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def request(port: int, raw: bytes | str) -> Reply:
    """Send one raw request with Connection: close and read the whole answer."""
    data = raw.encode() if isinstance(raw, str) else raw
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        raw_reply = await asyncio.wait_for(reader.read(), 2.0)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head, _, body = raw_reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    return Reply(status, headers, body)


async def get(port: int, path: str, method: str = "GET") -> Reply:
    return await request(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")


# A small JSON Schema validator: the keywords msgspec emits, nothing else (jsonschema is
# used instead when installed).

_ANNOTATIONS = {"title", "description", "default", "$schema", "$defs", "examples"}
_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _schema_errors(value: Any, schema: dict[str, Any], root: dict[str, Any], at: str) -> list[str]:
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        return _schema_errors(value, root["$defs"][name], root, at)
    errors: list[str] = []
    for key, rule in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key == "anyOf":
            if all(_schema_errors(value, s, root, at) for s in rule):
                errors.append(f"{at}: matches no alternative")
        elif key == "enum":
            if value not in rule:
                errors.append(f"{at}: {value!r} not in {rule}")
        elif key == "type":
            if rule == "integer":
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif rule == "number":
                ok = isinstance(value, int | float) and not isinstance(value, bool)
            else:
                ok = isinstance(value, _TYPES[rule]) and (
                    rule == "boolean" or not isinstance(value, bool)
                )
            if not ok:
                return [f"{at}: {value!r} is not of type {rule}"]
        elif key == "properties":
            for name, sub in rule.items():
                if name in value:
                    errors += _schema_errors(value[name], sub, root, f"{at}.{name}")
        elif key == "required":
            errors += [f"{at}: missing {name}" for name in rule if name not in value]
        elif key == "additionalProperties":
            extra = {k: v for k, v in value.items() if k not in schema.get("properties", {})}
            if rule is False and extra:
                errors.append(f"{at}: unexpected {sorted(extra)}")
            elif isinstance(rule, dict):
                for k, v in extra.items():
                    errors += _schema_errors(v, rule, root, f"{at}.{k}")
        elif key == "items":
            for i, item in enumerate(value):
                errors += _schema_errors(item, rule, root, f"{at}[{i}]")
        elif key == "minLength" and len(value) < rule:
            errors.append(f"{at}: shorter than {rule}")
        elif key == "maxLength" and len(value) > rule:
            errors.append(f"{at}: longer than {rule}")
        elif key == "pattern" and not re.search(rule, value):
            errors.append(f"{at}: {value!r} does not match {rule}")
        elif key == "minimum" and value < rule:
            errors.append(f"{at}: below {rule}")
        elif key == "maximum" and value > rule:
            errors.append(f"{at}: above {rule}")
        elif key not in {"minLength", "maxLength", "pattern", "minimum", "maximum"}:
            raise AssertionError(f"schema keyword {key!r} is not supported by this validator")
    return errors


def validate(value: Any, schema: dict[str, Any]) -> None:
    """Raise AssertionError when `value` does not satisfy `schema`."""
    try:
        jsonschema = importlib.import_module("jsonschema")
    except ImportError:
        problems = _schema_errors(value, schema, schema, "$")
        assert not problems, problems
    else:
        validator = jsonschema.Draft202012Validator(schema)
        validator.check_schema(schema)
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, errors


def test_schema_validator_rejects_a_broken_report() -> None:
    """The test's validator really checks types, patterns and required fields."""
    schema = messages.json_schemas()["HealthReport"]
    good = msgspec.to_builtins(health.report(READY, health.conditions(READY, [], 1.0), 2.0))
    validate(good, schema)
    for broken in (
        {**good, "node": "Not_A_Name"},
        {**good, "slot": -1},
        {k: v for k, v in good.items() if k != "daemon"},
        {**good, "conditions": [{**good["conditions"][0], "status": "Maybe"}]},
    ):
        with pytest.raises(AssertionError):
            validate(broken, schema)


# Endpoints


async def test_healthz_is_200_while_heartbeats_are_fresh(agent: Agent) -> None:
    """Liveness lists the watched tasks while every one of them beats."""
    reply = await get(agent.server.port, "/healthz")
    assert reply.status == 200
    assert reply.json() == {"live": True, "tasks": ["bus", "main"]}


async def test_healthz_is_503_naming_the_wedged_task(agent: Agent) -> None:
    """A task silent for more than three of its intervals fails liveness, by name."""
    agent.clock.t += 5.0
    agent.heartbeats.beat("bus")
    reply = await get(agent.server.port, "/healthz")
    assert reply.status == 503
    body = reply.json()
    assert body["stale"] == [{"task": "main", "age_s": 5.0, "interval_s": 1.0}]
    assert body["reason"] == "task main silent for 5.0 s (interval 1 s)"


async def test_healthz_does_not_depend_on_the_broker(agent: Agent) -> None:
    """A broker outage makes the node unready but never unlive."""
    agent.health.update(replace(READY, bus=BusFacts(last_error="connection refused")))
    assert (await get(agent.server.port, "/healthz")).status == 200
    reply = await get(agent.server.port, "/readyz")
    assert reply.status == 503
    assert reply.json()["failing"][0]["type"] == "BusConnected"


async def test_readyz_200_when_ready(agent: Agent) -> None:
    """A ready node answers 200 on /readyz."""
    reply = await get(agent.server.port, "/readyz")
    assert (reply.status, reply.json()) == (200, {"ready": True})


async def test_readyz_503_lists_failing_conditions(agent: Agent) -> None:
    """Unready answers carry the failing conditions and a one-line reason."""
    crash = replace(
        READY.daemon, state="FATAL", pid=None, reason="DaemonCrashLoop", message="exit 3: boom"
    )
    agent.health.update(replace(READY, daemon=crash))
    reply = await get(agent.server.port, "/readyz")
    assert reply.status == 503
    body = reply.json()
    assert body["ready"] is False
    assert body["reason"] == "DaemonReady=False DaemonCrashLoop: exit 3: boom"
    assert [(c["type"], c["reason"]) for c in body["failing"]] == [
        ("DaemonReady", "DaemonCrashLoop")
    ]
    msgspec.convert(body["failing"][0], messages.Condition)


async def test_status_validates_against_the_schema(agent: Agent) -> None:
    """/status serves a HealthReport that the shipped JSON Schema accepts."""
    reply = await get(agent.server.port, "/status")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("application/json")
    body = reply.json()
    validate(body, messages.json_schemas()["HealthReport"])
    rep = msgspec.convert(body, HealthReport)
    assert (rep.node, rep.domain, rep.slot, rep.ready) == ("n1", "d1", 0, True)
    assert rep.daemon.restarts == 2
    assert rep.domain_view is not None
    assert rep.domain_view.status == "UP"


async def test_status_of_an_idle_node_validates() -> None:
    """An idle node's report (no domain, no slot) is valid too."""
    async with serving(Facts(node="n1", bus=BusFacts(connected=True, synced=True))) as a:
        body = (await get(a.server.port, "/status")).json()
    validate(body, messages.json_schemas()["HealthReport"])
    assert (body["domain"], body["slot"], body["ready"]) == (None, None, True)


async def test_metrics_parse_and_follow_the_facts(agent: Agent) -> None:
    """/metrics is Prometheus text with every family, current as of the scrape."""
    agent.metrics.count_write("hosts", ok=False)
    agent.metrics.observe_reconcile(0.02)
    reply = await get(agent.server.port, "/metrics")
    assert reply.status == 200
    assert reply.headers["content-type"] == CONTENT_TYPE
    families = {f.name: f for f in text_string_to_metric_families(reply.body.decode())}
    assert {
        "imexd_daemon_state",
        "imexd_daemon_restarts",
        "imexd_daemon_reloads",
        "imexd_bus_connected",
        "imexd_bus_reconnects",
        "imexd_bus_stale_retained",
        "imexd_bus_resync_corrections",
        "imexd_bus_dropped",
        "imexd_domain_members",
        "imexd_slot",
        "imexd_domain_state",
        "imexd_reconcile_seconds",
        "imexd_file_writes",
        "imexd_file_write_failures",
        "imexd_probe_failures",
        "imexd_ready",
        "imexd_info",
    } <= set(families)

    def value(family: str, **labels: str) -> float:
        for s in families[family].samples:
            if all(s.labels.get(k) == v for k, v in labels.items()) and not s.name.endswith(
                "_created"
            ):
                return float(s.value)
        raise KeyError((family, labels))

    assert value("imexd_daemon_state", state="RUNNING") == 1.0
    assert value("imexd_daemon_state", state="FATAL") == 0.0
    assert value("imexd_daemon_restarts") == 2.0
    assert value("imexd_daemon_reloads") == 5.0
    assert value("imexd_ready") == 1.0
    assert value("imexd_slot") == 0.0
    assert value("imexd_domain_members") == 2.0
    assert value("imexd_domain_state", state="UP") == 1.0
    assert value("imexd_file_write_failures", file="hosts") == 1.0
    assert value("imexd_info", node="n1", domain="d1", clique="c0ffee.1") == 1.0

    agent.health.update(
        replace(
            READY,
            bus=BusFacts(
                reconnects=3, stale_retained=2, resync_corrections=1, dropped={"schema": 4}
            ),
        )
    )
    text = (await get(agent.server.port, "/metrics")).body.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert value("imexd_bus_connected") == 0.0
    assert value("imexd_bus_reconnects") == 3.0
    assert value("imexd_bus_stale_retained") == 2.0
    assert value("imexd_bus_resync_corrections") == 1.0
    assert value("imexd_bus_dropped", reason="schema") == 4.0
    assert value("imexd_bus_dropped", reason="not_json") == 0.0
    assert value("imexd_ready") == 0.0


@pytest.mark.parametrize("path", ["/", "/healthz/", "/status.json", "/metrics/x"])
async def test_unknown_paths_are_404(agent: Agent, path: str) -> None:
    """Only the four endpoints exist."""
    assert (await get(agent.server.port, path)).status == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "HEAD", "OPTIONS"])
async def test_other_methods_are_405(agent: Agent, method: str) -> None:
    """Every endpoint is GET only, and says so."""
    reply = await get(agent.server.port, "/readyz", method)
    assert reply.status == 405
    assert reply.headers["allow"] == "GET"


async def test_requests_with_a_body_are_refused(agent: Agent) -> None:
    """A GET with a body is 413 and its body is never read."""
    reply = await request(
        agent.server.port,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nxx",
    )
    assert reply.status == 413


@pytest.mark.parametrize(
    "raw",
    [
        "GET /" + "a" * 3000 + " HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + "b" * 5000 + "\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nHost: x\r\n"
        + "".join(f"X-{i}: y\r\n" for i in range(40))
        + "\r\n",
    ],
    ids=["long-url", "big-header", "many-headers"],
)
async def test_oversized_headers_are_rejected(agent: Agent, raw: str) -> None:
    """Request line, header field and header count are capped."""
    reply = await request(agent.server.port, raw)
    assert 400 <= reply.status < 500


async def test_keep_alive_serves_several_requests(agent: Agent) -> None:
    """A scraper may reuse its connection for the next request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.server.port)
    try:
        for _ in range(3):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
            match = re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE)
            assert match is not None
            length = int(match[1])
            await asyncio.wait_for(reader.readexactly(length), 2)
            assert head.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
        await writer.wait_closed()


async def _closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    try:
        data = await asyncio.wait_for(reader.read(1024), within)
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return data == b"" or data.startswith(b"HTTP/1.1 4")


async def test_slow_and_idle_clients_are_cut_off() -> None:
    """A client that does not finish its request in time is disconnected."""
    async with serving(READY, ServerLimits(request_timeout_s=0.3)) as a:
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", a.server.port)
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", a.server.port)

        async def dribble() -> None:
            for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\n":
                if slow_w.is_closing():
                    return
                slow_w.write(bytes([byte]))
                await asyncio.sleep(0.05)

        task = asyncio.create_task(dribble())
        started = time.monotonic()
        try:
            assert await _closed_by_server(idle_r, 2.0)
            assert await _closed_by_server(slow_r, 2.0)
            assert time.monotonic() - started < 1.5
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task
            for w in (idle_w, slow_w):
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()


async def test_probe_answers_within_a_second_with_200_slow_clients() -> None:
    """With 200 idle or byte-at-a-time clients connected, /healthz still answers in < 1 s."""
    limits = ServerLimits()
    async with serving(READY, limits) as a:
        port = a.server.port
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(200)]
        dribblers = [w for i, (_, w) in enumerate(conns) if i % 2]
        payload = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 4000

        async def dribble() -> None:
            for i in range(len(payload)):
                for w in dribblers:
                    if not w.is_closing():
                        w.write(payload[i : i + 1])
                await asyncio.sleep(0.02)

        task = asyncio.create_task(dribble())
        try:
            await asyncio.sleep(0.3)
            for path, status in (("/healthz", 200), ("/readyz", 200), ("/healthz", 200)):
                started = time.monotonic()
                reply = await asyncio.wait_for(get(port, path), 1.0)
                elapsed = time.monotonic() - started
                assert reply.status == status
                assert elapsed < 1.0
                await asyncio.sleep(0.1)
            assert a.server.open_connections <= limits.max_connections
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for _, w in conns:
                w.close()
            await asyncio.wait_for(
                asyncio.gather(*(w.wait_closed() for _, w in conns), return_exceptions=True), 5
            )
        evicted = sum(1 for r, _ in conns if r.at_eof())
        assert evicted >= 200 - limits.max_connections


async def test_connection_cap_evicts_the_quietest_connection() -> None:
    """Past the cap, the connection quiet the longest is closed, not the newcomer."""
    async with serving(READY, ServerLimits(max_connections=3)) as a:
        port = a.server.port
        conns = []
        for _ in range(3):
            conns.append(await asyncio.open_connection("127.0.0.1", port))
            await asyncio.sleep(0.01)
        try:
            first_r = conns[0][0]
            reply = await get(port, "/healthz")
            assert reply.status == 200
            assert await _closed_by_server(first_r, 2.0)
            assert a.server.open_connections <= 3
        finally:
            for _, w in conns:
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()


# Lifecycle


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port with a listener already on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


async def test_bind_failure_is_fatal(busy_port: int) -> None:
    """An endpoint that cannot listen ends the agent with the address in the message."""
    server = HealthServer(
        f"127.0.0.1:{busy_port}",
        heartbeats=Heartbeats(),
        health=Health(READY),
        metrics=Metrics(),
    )
    with pytest.raises(FatalError, match=f"127.0.0.1:{busy_port}"):
        async with server:
            pass


async def test_port_zero_binds_a_free_port_and_releases_it() -> None:
    """Port 0 picks a free port, reported by `port` and `url`, freed on exit."""
    async with serving(READY) as a:
        port = a.server.port
        assert port > 0
        assert a.server.url == f"http://127.0.0.1:{port}"
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


# Metrics without a server


def test_metrics_before_any_facts_still_render() -> None:
    """A registry without facts yet renders the event series only."""
    m = Metrics(version="9.9")
    m.count_probe_failure("local")
    families = {f.name for f in text_string_to_metric_families(m.render().decode())}
    assert "imexd_probe_failures" in families
    assert "imexd_info" not in families


def test_metrics_registries_are_private() -> None:
    """Two agents in one process (the demo) do not share series."""
    a, b = Metrics(), Metrics()
    a.count_write("hosts", ok=True)
    assert b'imexd_file_writes_total{file="hosts"} 0.0' in b.render()
    assert b'imexd_file_writes_total{file="hosts"} 1.0' in a.render()


def test_metrics_idle_node() -> None:
    """An idle node has slot -1, no members and no domain state."""
    m = Metrics()
    idle = Facts(node="n1", bus=BusFacts(connected=True, synced=True))
    m.update_from(idle, health.conditions(idle, [], 0.0))
    text = m.render().decode()
    assert "imexd_slot -1.0" in text
    assert 'imexd_domain_state{state="FORMING"} 0.0' in text
    assert "imexd_ready 1.0" in text


def test_metrics_carry_each_condition_with_its_reason() -> None:
    """imexd_condition shows every condition's current status and reason, one series per
    type, so alert rules can name a reason (PublishRefused, NodeMapMismatch, ...)."""
    m = Metrics()
    refused = Facts(
        node="n1",
        bus=BusFacts(connected=True, synced=True, refused=("imex/v2/domains/d1/health/n1",)),
    )
    m.update_from(refused, health.conditions(refused, [], 0.0))
    conditions = {
        s.labels["type"]: (s.labels["status"], s.labels["reason"], s.value)
        for f in text_string_to_metric_families(m.render().decode())
        if f.name == "imexd_condition"
        for s in f.samples
    }
    assert conditions["BusConnected"] == ("False", "PublishRefused", 1.0)
    assert set(conditions) == set(messages.CONDITION_TYPES)
    idle = Facts(node="n1", bus=BusFacts(connected=True, synced=True))
    m.update_from(idle, health.conditions(idle, [], 0.0))
    text = m.render().decode()
    assert 'reason="PublishRefused"' not in text, "a changed condition leaves no stale series"


async def test_a_client_that_never_reads_its_answers_is_cut_off() -> None:
    """Requests pipelined by a client that reads nothing fill the socket buffers; the
    answer's write is bounded by the request timeout too, so the connection is closed
    instead of being held forever."""
    async with serving(READY, ServerLimits(request_timeout_s=0.3)) as a:
        _, writer = await asyncio.open_connection("127.0.0.1", a.server.port)
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 5000)
            await until(lambda: a.server.open_connections == 0, within=10, interval=0.1)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def test_the_reason_phrases_are_the_standard_ones() -> None:
    """The server's own table of reason phrases says what http.HTTPStatus says."""
    from http import HTTPStatus

    from imexd.health.http import REASONS

    assert {code: HTTPStatus(code).phrase for code in REASONS} == REASONS
