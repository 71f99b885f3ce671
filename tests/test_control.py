"""The control plane: its store, its link and every command against a real Mosquitto.

The pure judgement and the tables it prints are tested in test_fleet.py. Here the commands
run in-process (`imexd.cli.main` in a worker thread, so a fake agent can answer on the
test's loop) or as `imexd` subprocesses for exit codes, and what they leave on the broker
is read back with a raw client and validated against the shipped JSON Schemas.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec
import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped] # no stubs

from imexd import facts as fx
from imexd.bus.mqtt import topic_matches
from imexd.cli.control import SEEN_WITHIN_DEFAULT_S
from imexd.cli.main import build_parser, main
from imexd.control import commands
from imexd.control.link import Link
from imexd.control.schemas import outdated_schemas, schema_texts
from imexd.control.store import Store, summarize
from imexd.demo.brokers import free_port
from imexd.demo.scenario import Demo
from imexd.errors import BusError
from imexd.health.fleet import (
    DomainState,
    render_list,
)
from imexd.messages import (
    Assignment,
    DomainSpec,
    MemberState,
    Presence,
    Received,
    WorkloadRecord,
    encode,
    json_schemas,
)
from imexd.settings import BusSettings
from imexd.topics import TopicRef, Topics
from tests.brokers import Mosquitto
from tests.faultproxy import FaultProxy, RefusedSubscriptions
from tests.reports import CRASH, INTERVAL, NOW, SPEC, THREE, member_record, report
from tests.support import IMEXD, imexd, raw_client, spy_calls

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = REPO / "docs" / "schemas"
T = Topics("imex/v2")
WAIT_S = 10.0


# Real broker helpers.


async def put(broker: Mosquitto, items: Mapping[str, bytes | None]) -> None:
    """Retained QoS 1 publishes (None or b"": delete), as agents write their records."""
    async with raw_client(broker) as c:
        for topic, payload in items.items():
            await c.publish(topic, payload or None, qos=1, retain=True)


async def retained(broker: Mosquitto, topic_filter: str = "imex/v2/#") -> dict[str, bytes]:
    """Every retained message under `topic_filter` now, by topic."""
    barrier = f"test/barrier/{uuid.uuid4().hex}"
    found: dict[str, bytes] = {}
    async with raw_client(broker) as c, asyncio.timeout(WAIT_S):
        await c.subscribe([(topic_filter, 1), (barrier, 1)])
        await c.publish(barrier, b"x", qos=1)
        async for message in c.messages:
            if message.topic.value == barrier:
                return found
            if message.retain:
                assert isinstance(message.payload, bytes)
                found[message.topic.value] = message.payload
    raise AssertionError("unreachable: the message iterator ended")


def tombstone(topic: str, payload: bytes) -> bool:
    """Whether `payload` is a control-plane tombstone (imexd.order): a spec or workload
    `deleted`, an assignment to no domain, a retry request `done`."""
    try:
        doc = json.loads(payload)
    except ValueError:
        return False
    if not isinstance(doc, dict):
        return False
    if topic.endswith("/assignment"):
        return "domain" in doc and doc["domain"] is None
    return doc.get("state") in ("deleted", "done")


async def standing(broker: Mosquitto, topic_filter: str = "imex/v2/#") -> dict[str, bytes]:
    """`retained` without the tombstones: what the bus says exists."""
    got = await retained(broker, topic_filter)
    return {t: p for t, p in got.items() if not tombstone(t, p)}


def validator(kind: str) -> Draft202012Validator:
    schema = json.loads((SCHEMAS / f"{kind}.json").read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def valid(kind: str, payload: bytes) -> dict[str, Any]:
    """The payload as JSON, after checking it against the shipped schema of `kind`."""
    doc: dict[str, Any] = json.loads(payload)
    validator(kind).validate(doc)
    return doc


@pytest.fixture
def env(broker: Mosquitto, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment of a control plane that reaches `broker` with no settings file."""
    for name in list(os.environ):
        if name.startswith("IMEXD_"):
            monkeypatch.delenv(name)
    values = {
        "IMEXD_BUS_URL": broker.url,
        "IMEXD_DOMAIN_MAX_NODES": "8",
        "IMEXD_HEALTH_REPORT_INTERVAL_S": "30",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def control(*args: str) -> int:
    """Run `imexd ARGS` in-process (a fresh event loop); its exit status."""
    return main(list(args))


async def control_async(*args: str) -> int:
    """`control` in a worker thread, so fake agents keep running on the test's loop."""
    return await asyncio.to_thread(main, list(args))


# Components: each command against a real broker.


async def seen(broker: Mosquitto, *nodes: str) -> dict[str, bytes]:
    """Retain a fresh presence record for each node, as their running agents do."""
    items = {T.presence(n): presence(n) for n in nodes}
    await put(broker, items)
    return items


async def test_create_publishes_exactly_the_spec_and_the_assignments(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`domain create` leaves one spec and one assignment per listed node, all valid."""
    presences = await seen(broker, "n1", "n2", "n3")
    assert await control_async("domain", "create", "d1", "--nodes", "n1,n2,n3") == 0
    got = await retained(broker)
    for topic in presences:
        got.pop(topic)
    assert sorted(got) == sorted([T.spec("d1"), *(T.assignment(n) for n in ("n1", "n2", "n3"))])
    spec = valid("DomainSpec", got[T.spec("d1")])
    first = spec.pop("generation")
    assert abs(first - time.time()) < 60, "a new record's generation is the clock's second"
    assert spec.pop("at") > 0
    assert spec == {
        "v": 1,
        "domain": "d1",
        "nodes": ["n1", "n2", "n3"],
        "max_nodes": 8,
        "state": "active",
    }
    for node in ("n1", "n2", "n3"):
        written = valid("Assignment", got[T.assignment(node)])
        assert written["domain"] == "d1"
        assert abs(written["generation"] - time.time()) < 60
    assert (
        f"domain d1: created (generation {first}, max_nodes 8, nodes n1,n2,n3)"
        in capsys.readouterr().out
    )


async def test_create_reads_the_listed_nodes_in_one_snapshot(
    broker: Mosquitto, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 43: the checks of `domain create --nodes` and `node assign` (another live
    domain, a live agent) ask only about the listed nodes: their member records, reports
    and presences come in one snapshot. Reading every member of the fleet made a second
    round trip for every member's presence, and grew with the fleet."""
    await seen(broker, "n1", "n2", "x1", "x2")
    await put(
        broker,
        {
            T.member("s0", "c1", n): encode(member_record(n, i, domain="s0"))
            for i, n in enumerate(("x1", "x2"))
        },
    )
    calls = spy_calls(monkeypatch, Link, "sync", "read")

    def syncs() -> list[str]:
        return [name for name, _ in calls if name == "sync"]

    def read() -> list[str]:
        return [f for name, filters in calls if name == "read" for f in filters]

    assert await control_async("domain", "create", "d1", "--nodes", "n1,n2") == 0
    assert syncs() == ["sync", "sync"], calls  # the snapshot, then the check of the writes
    assert not [f for f in read() if "x1" in f or "x2" in f or f.endswith("/+/+")], read()
    calls.clear()
    assert await control_async("node", "assign", "n2", "d1") == 0  # the same checks
    assert syncs() == ["sync", "sync"], calls
    assert not [f for f in read() if "x1" in f or "x2" in f or f.endswith("/+/+")], read()


async def test_create_again_bumps_the_generation_and_keeps_max_nodes(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A second create is an update: generation + 1, the spec's max_nodes kept."""
    assert await control_async("domain", "create", "d1", "--max-nodes", "4") == 0
    first = valid("DomainSpec", (await retained(broker))[T.spec("d1")])["generation"]
    await seen(broker, "n2")
    assert await control_async("domain", "create", "d1", "--nodes", "n2") == 0
    got = await retained(broker)
    spec = valid("DomainSpec", got[T.spec("d1")])
    assert (spec["generation"], spec["max_nodes"], spec["nodes"]) == (first + 1, 4, ["n2"])
    assert f"domain d1: updated (generation {first + 1}" in capsys.readouterr().out


async def test_create_says_when_a_node_moves_from_another_domain(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Assigning a node that belongs elsewhere moves it, and says so."""
    await put(broker, {T.assignment("n1"): encode(Assignment(domain="d0"))})
    await seen(broker, "n1")
    assert await control_async("domain", "create", "d1", "--nodes", "n1") == 0
    assert "node n1: assigned to d1 (moved from d0)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["domain", "create", "D1"], "not a DNS-1123 label"),
        (["domain", "create", "d1-"], "not a DNS-1123 label"),
        (["domain", "create", "d" * 64], "not a DNS-1123 label"),
        (["domain", "create", "d1", "--nodes", "n1,N2"], "'N2' is not a DNS-1123 subdomain"),
        (["domain", "create", "d1", "--nodes", "n1,n1"], "lists n1 more than once"),
        (["domain", "create", "d1", "--nodes", "n1,,n2"], "has an empty name"),
        (["domain", "create", "d1", "--max-nodes", "0"], "expected 1 to 2048"),
        (["domain", "delete", "d_1"], "not a DNS-1123 label"),
        (["domain", "delete", "d1", "--wait", "-1"], "expected seconds >= 0"),
        (["domain", "create", "d1", "--wait", "-1"], "expected seconds >= 0"),
        (["domain", "status", "D"], "not a DNS-1123 label"),
        (["node", "assign", "n_1", "d1"], "not a DNS-1123 subdomain"),
        (["node", "assign", "n1", "d.1"], "not a DNS-1123 label"),
        (["node", "unassign", "N1"], "not a DNS-1123 subdomain"),
    ],
)
def test_bad_names_exit_2_with_a_clear_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Names that are not DNS-1123 are refused before any broker is contacted."""
    assert control(*args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("imexd ")


async def test_assign_and_unassign_write_the_assignment_and_its_tombstone(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`node assign` retains {"v":1,"domain":D,...}; `node unassign` its tombstone, an
    assignment to no domain one generation up."""
    await put(broker, {T.presence("gpu-01.example.com"): presence("gpu-01.example.com")})
    assert await control_async("node", "assign", "gpu-01.example.com", "d2") == 0
    got = await retained(broker, T.assignments_filter())
    written = valid("Assignment", got[T.assignment("gpu-01.example.com")])
    assert written["domain"] == "d2"
    assert await control_async("node", "unassign", "gpu-01.example.com") == 0
    gone = await retained(broker, T.assignments_filter())
    tombstone = valid("Assignment", gone[T.assignment("gpu-01.example.com")])
    assert (tombstone["domain"], tombstone["generation"]) == (None, written["generation"] + 1)
    out = capsys.readouterr().out
    assert "node gpu-01.example.com: assigned to d2" in out
    assert "node gpu-01.example.com: unassigned (was d2)" in out


async def test_assign_warns_when_the_spec_keeps_the_node_out(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Assigning a node that the spec's list leaves out warns about NotInSpec."""
    await put(broker, {T.spec("d1"): encode(SPEC), T.presence("n9"): presence("n9")})
    assert await control_async("node", "assign", "n9", "d1") == 0
    assert "n9 stays out (NotInSpec)" in capsys.readouterr().err


def presence(
    node: str,
    *,
    at: float | None = None,
    stopped: float | None = None,
    incarnation: int = 1,
    lost: bool = False,
) -> bytes:
    """An agent's retained presence record, written `at` (default: now); `stopped`: its
    last word, as a cleanly stopped agent writes it; `lost`: an idle agent's will."""
    return encode(
        Presence(
            node=node,
            incarnation=incarnation,
            at=time.time() if at is None else at,
            domain=None,
            address="127.0.0.20",
            stopped=stopped,
            lost=lost,
        )
    )


LIVE_D0 = {
    T.spec("d0"): encode(DomainSpec(domain="d0", nodes=["n1"], max_nodes=8, generation=3)),
    T.assignment("n1"): encode(Assignment(domain="d0")),
}


async def test_create_refuses_a_node_assigned_to_another_live_domain(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A listed node assigned to an active domain: exit 2 naming both, nothing written."""
    await put(broker, LIVE_D0)
    assert await control_async("domain", "create", "d1", "--nodes", "n1,n2") == 2
    err = capsys.readouterr().err
    assert (
        "imexd domain create: node n1 is in another domain: assigned to d0 (spec generation 3, "
        "active)" in err
    )
    assert "give --steal" in err
    assert "n2" not in err
    assert await retained(broker) == LIVE_D0, "nothing was written"


async def test_create_refuses_a_node_with_a_record_in_another_domain(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A member record in another domain (a static node, say) holds the node too."""
    await put(broker, {T.member("s0", "c1", "n2"): encode(member_record("n2", 0, domain="s0"))})
    assert await control_async("domain", "create", "d1", "--nodes", "n1,n2") == 2
    assert "node n2 is in another domain: member record in s0" in capsys.readouterr().err
    assert T.spec("d1") not in await retained(broker)


async def test_create_with_steal_moves_the_node(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--steal` moves a node out of a live domain and says so."""
    await put(broker, LIVE_D0)
    await seen(broker, "n1")
    assert await control_async("domain", "create", "d1", "--nodes", "n1", "--steal") == 0
    assert "node n1: assigned to d1 (moved from d0)" in capsys.readouterr().out
    got = await retained(broker)
    assert valid("Assignment", got[T.assignment("n1")])["domain"] == "d1"


async def test_a_deleting_or_missing_spec_holds_no_node(
    broker: Mosquitto, env: dict[str, str]
) -> None:
    """An assignment to a domain that is being deleted, or has no spec, is no conflict."""
    deleting = DomainSpec(domain="d0", nodes=["n1"], max_nodes=8, state="deleting")
    await put(
        broker,
        {
            T.spec("d0"): encode(deleting),
            T.assignment("n1"): encode(Assignment(domain="d0")),
            T.assignment("n2"): encode(Assignment(domain="gone")),
        },
    )
    await seen(broker, "n1", "n2")
    assert await control_async("domain", "create", "d1", "--nodes", "n1,n2") == 0


async def test_assign_refuses_a_node_of_another_live_domain_unless_steal(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`node assign` guards like create: exit 2 naming node and domain; steal moves it."""
    await put(broker, LIVE_D0 | {T.presence("n1"): presence("n1")})
    assert await control_async("node", "assign", "n1", "d1") == 2
    err = capsys.readouterr().err
    assert "imexd node assign: node n1 is in another domain: assigned to d0" in err
    assert valid("Assignment", (await retained(broker))[T.assignment("n1")])["domain"] == "d0"
    assert await control_async("node", "assign", "n1", "d1", "--steal") == 0
    assert "node n1: assigned to d1 (moved from d0)" in capsys.readouterr().out


async def test_assign_refuses_a_node_no_agent_reported_unless_force(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A node never reported, or not within --seen-within, is refused; --force assigns it."""
    assert await control_async("node", "assign", "typo-n1", "d1") == 2
    err = capsys.readouterr().err
    assert "imexd node assign: no agent reported node typo-n1 within 600 s (never)" in err
    assert "--force" in err
    assert await retained(broker) == {}
    old = time.time() - 1000
    await put(broker, {T.presence("n2"): presence("n2", at=old)})
    assert await control_async("node", "assign", "n2", "d1") == 2
    assert "within 600 s (last 1000 s ago)" in capsys.readouterr().err
    assert await control_async("node", "assign", "n2", "d1", "--seen-within", "1200") == 0
    assert await control_async("node", "assign", "typo-n1", "d1", "--force") == 0
    got = await retained(broker, T.assignments_filter())
    assert sorted(got) == [T.assignment("n2"), T.assignment("typo-n1")]


def lost(node: str, domain: str = "d1") -> bytes:
    """The tombstone a crashed agent's will leaves on its member topic."""
    record = member_record(node, 0, domain=domain)
    return encode(msgspec.structs.replace(record, slot=None, state=MemberState.LOST))


async def test_forget_clears_a_lost_node_everywhere_but_its_assignment(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A node gone for good leaves its tombstone (state lost, the domain DEGRADED for good),
    its last health report and its presence: `node forget` clears those, keeps the
    assignment (that is `node unassign`) and touches no other node."""
    old = time.time() - 1000
    kept = {
        T.member("d1", "c1", "n2"): encode(member_record("n2", 1)),
        T.assignment("n1"): encode(Assignment(domain="d1")),
    }
    await put(
        broker,
        {
            **kept,
            T.member("d1", "c1", "n1"): lost("n1"),
            T.health("d1", "n1"): encode(report("n1", 0, {0: "n1"}, at=old)),
            T.presence("n1"): presence("n1", at=old),
        },
    )
    assert await control_async("node", "forget", "n1") == 0
    assert await retained(broker) == kept
    out = capsys.readouterr().out
    assert "node n1: forgot the lost member record in d1, 1 health report(s), its presence" in out
    assert "still assigned to d1" in out
    assert await control_async("node", "forget", "n1") == 0
    assert "node n1: nothing to forget" in capsys.readouterr().out


async def test_forget_refuses_a_live_node_and_a_stale_record_without_force(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Forgetting a running agent's record would drop it from its peers' files: refused,
    exit 2, nothing written. A record that is not a tombstone but whose node no agent
    reported within --seen-within (a broker restored without the session that would fire
    the will) is cleared only with --force."""
    live = {
        T.member("d1", "c1", "n1"): encode(member_record("n1", 0)),
        T.presence("n1"): presence("n1"),
    }
    await put(broker, live)
    assert await control_async("node", "forget", "n1") == 2
    err = capsys.readouterr().err
    assert "node n1 is live (member record in d1, reported" in err
    assert await retained(broker) == live
    assert await control_async("node", "forget", "n1", "--force") == 2
    assert await retained(broker) == live
    await put(broker, {T.presence("n1"): presence("n1", at=time.time() - 1000)})
    assert await control_async("node", "forget", "n1") == 2
    assert "not reported within 600 s" in capsys.readouterr().err
    assert await control_async("node", "forget", "n1", "--force") == 0
    assert await retained(broker) == {}


def unseen(lines: list[str]) -> list[str]:
    """The nodes `domain create` refused as not reported, in the order it named them."""
    return [m.group(1) for line in lines if (m := re.search(r"reported node (\S+) within", line))]


async def test_create_refuses_nodes_no_live_agent_reported_unless_force(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`domain create --nodes` names every listed node that no agent reported within
    --seen-within (never, too long ago, or only its will's lost record) and writes nothing
    (exit 2), so a Slurm prolog fails at once; --force or a longer window creates it."""
    lost = msgspec.structs.replace(
        member_record("n4", 3, domain="d1"), state=MemberState.LOST, slot=None
    )
    before = {
        T.presence("n1"): presence("n1"),
        T.presence("n2"): presence("n2", at=time.time() - 1000),
        T.member("d1", "c1", "n4"): encode(lost),
        T.presence("n4"): presence("n4", at=time.time() - 900),
    }
    await put(broker, before)
    args = ("domain", "create", "d1", "--nodes", "n1,n2,n3,n4")
    assert await control_async(*args) == 2
    err = capsys.readouterr().err.splitlines()
    assert unseen(err) == ["n2", "n3"]
    assert err[0].startswith(
        "imexd domain create: no agent reported node n2 within 600 s (last 1000 s ago): "
        "a typo, or a node without a running agent; d1 would wait for it forever. Give "
        "--force"
    )
    assert "node n3 within 600 s (never)" in err[1]
    assert err[2].startswith("imexd domain create: node n4: AgentDown: its agent's link ended")
    assert await retained(broker) == before, "nothing was written"
    assert await control_async(*args, "--seen-within", "950") == 2
    err = capsys.readouterr().err.splitlines()
    assert unseen(err) == ["n2", "n3"], "n4 is not unseen but gone: its will says so"
    assert [line.split(":")[1] for line in err if "AgentDown" in line] == [" node n4"]
    assert await control_async(*args, "--seen-within", "-1") == 2
    assert "--seen-within -1: expected seconds >= 0" in capsys.readouterr().err
    assert await control_async(*args, "--force") == 0
    got = await retained(broker, T.assignments_filter())
    assert sorted(got) == sorted(T.assignment(n) for n in ("n1", "n2", "n3", "n4"))


async def test_a_node_whose_agent_stopped_or_died_is_refused_whatever_seen_within_says(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A stop is news (issue 25): an agent that stopped cleanly said so in its presence,
    and a dead one's will is on the bus; `domain create`, `node assign` and `workload
    create` refuse such a node at once (exit 2, AgentDown with the reason), however
    recent its last sighting. A later incarnation's presence, or a report after the stop,
    is an agent back."""
    now = time.time()
    lost = msgspec.structs.replace(
        member_record("n2", 1, domain="d1"), state=MemberState.LOST, slot=None
    )
    await put(
        broker,
        {
            T.presence("n1"): presence("n1", at=now - 5, stopped=now - 5),
            T.member("d1", "c1", "n2"): encode(lost),
            T.presence("n2"): presence("n2", at=now - 3),
            T.presence("n3"): presence("n3"),
        },
    )
    create = ("domain", "create", "d1", "--nodes", "n1,n2,n3", "--seen-within", "1e9")
    assert await control_async(*create) == 2
    err = capsys.readouterr().err
    assert "node n1: AgentDown: its agent stopped 5 s ago (a clean stop" in err, err
    assert "node n2: AgentDown: its agent's link ended without a goodbye (its will" in err
    assert "n3" not in err
    assert await retained(broker, T.specs_filter()) == {}, "nothing was written"
    assert await control_async("node", "assign", "n1", "d1") == 2
    assert "node n1: AgentDown" in capsys.readouterr().err
    assert (
        await control_async("workload", "create", "w1", "--domain", "d1", "--nodes", "n1,n3") == 2
    )
    assert "imexd workload create: node n1: AgentDown" in capsys.readouterr().err
    # Without --nodes, and no spec listing them, the workload is every member's: n2's too.
    assert await control_async("workload", "create", "w1", "--domain", "d1") == 2
    assert "imexd workload create: node n2: AgentDown" in capsys.readouterr().err
    assert await retained(broker, T.workloads_filter("d1")) == {}
    # An agent's will is its presence, marked lost.
    await put(broker, {T.presence("n4"): presence("n4", at=now - 60, lost=True)})
    assert await control_async("domain", "create", "d4", "--nodes", "n4") == 2
    assert "node n4: AgentDown: its agent's link ended without a goodbye (its Last Will is" in (
        capsys.readouterr().err
    )

    # Back: n1 restarted (a new presence), n2's next incarnation runs idle.
    await put(
        broker,
        {
            T.presence("n1"): presence("n1", incarnation=2),
            T.presence("n2"): presence("n2", incarnation=2),
        },
    )
    assert await control_async(*create) == 0, capsys.readouterr().err


async def test_a_health_report_or_a_record_is_a_sighting(
    broker: Mosquitto, env: dict[str, str]
) -> None:
    """Agents that publish no presence record yet are seen by their report or record."""
    await put(
        broker,
        {
            T.health("d5", "n3"): encode(report("n3", 0, {0: "n3"}, domain="d5", at=time.time())),
            T.member("s5", "c1", "n4"): encode(member_record("n4", 0, domain="s5")),
        },
    )
    assert await control_async("node", "assign", "n3", "d5") == 0
    assert await control_async("node", "assign", "n4", "s5") == 0


@contextlib.asynccontextmanager
async def fake_agents(
    broker: Mosquitto, nodes: list[str], domain: str = "d1"
) -> AsyncIterator[list[str]]:
    """Agents that clear their member record and health report when the spec says deleting.

    Yields the nodes that have left, in order.
    """
    left: list[str] = []

    async def agent(node: str) -> None:
        async with raw_client(broker) as c:
            await c.subscribe(T.spec(domain), qos=1)
            async for message in c.messages:
                raw = message.payload
                if isinstance(raw, bytes) and raw and json.loads(raw)["state"] == "deleting":
                    left.append(node)  # before the clears: the command may end at their echo
                    await c.publish(T.member(domain, "c1", node), None, qos=1, retain=True)
                    await c.publish(T.health(domain, node), None, qos=1, retain=True)
                    return

    tasks = [asyncio.create_task(agent(n), name=f"fake-{n}") for n in nodes]
    await asyncio.sleep(0.3)  # let them subscribe: a deleting spec is then delivered live
    try:
        yield left
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def domain_state(domain: str, nodes: list[str], assigned: bool = True) -> dict[str, bytes | None]:
    members = {n: s for s, n in enumerate(nodes)}
    out: dict[str, bytes | None] = {T.spec(domain): encode(SPEC)}
    for node, slot in members.items():
        out[T.member(domain, "c1", node)] = encode(member_record(node, slot, domain=domain))
        out[T.health(domain, node)] = encode(
            report(node, slot, dict(enumerate(nodes)), at=time.time())
        )
        if assigned:
            out[T.assignment(node)] = encode(Assignment(domain=domain))
    return out


async def test_delete_waits_for_the_members_then_writes_the_tombstones(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Members leave on `deleting`; then the spec and the assignments become tombstones,
    one generation up, and the leftover report is cleared."""
    await put(broker, domain_state("d1", ["n1", "n2", "n3"]))
    ghost = {T.health("d1", "n9"): encode(report("n9", 5, {5: "n9"}, at=time.time()))}
    other = {T.assignment("m1"): encode(Assignment(domain="d2"))}
    await put(broker, ghost | other)
    async with fake_agents(broker, ["n1", "n2", "n3"]) as left:
        assert await control_async("domain", "delete", "d1", "--wait", "20") == 0
        assert sorted(left) == ["n1", "n2", "n3"]
    got = await retained(broker)
    spec = valid("DomainSpec", got.pop(T.spec("d1")))
    assert (spec["state"], spec["generation"]) == ("deleted", 3)
    for node in ("n1", "n2", "n3"):
        gone = valid("Assignment", got.pop(T.assignment(node)))
        assert (gone["domain"], gone["generation"]) == (None, 1)
    assert got == other
    out = capsys.readouterr().out
    assert "domain d1: deleting (generation 2); waiting up to 20 s for 3 member(s)" in out
    assert (
        "domain d1: deleted (spec generation 3, 3 assignment(s), 1 leftover health report(s))"
        in out
    )


async def test_delete_times_out_when_members_stay_and_keeps_a_deleting_spec(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Members that never leave: exit 1 naming them; the spec stays deleting, records stay."""
    await put(broker, domain_state("d1", ["n1", "n2"]))
    assert await control_async("domain", "delete", "d1", "--timeout", "0.5") == 1
    got = await retained(broker)
    assert valid("DomainSpec", got[T.spec("d1")])["state"] == "deleting"
    assert valid("Assignment", got[T.assignment("n1")])["domain"] is None
    assert T.member("d1", "c1", "n1") in got
    assert T.health("d1", "n1") in got
    err = capsys.readouterr().err
    assert "2 member(s) still hold records after 0.5 s: n1 (record member, last report" in err
    assert "Run `imexd domain delete d1` again" in err


async def test_delete_clears_a_crashed_members_tombstone_without_waiting_for_it(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A member that crashed left its will, a `lost` tombstone, and will not leave: the
    delete (a Slurm epilog after a node failure) clears it with the rest instead of
    waiting out its timeout and keeping a deleting spec; the node is then free for the
    next domain."""
    state = domain_state("d1", ["n1", "n2"])
    state[T.member("d1", "c1", "n2")] = lost("n2")
    await put(broker, state)
    async with fake_agents(broker, ["n1"]) as left:
        assert await control_async("domain", "delete", "d1", "--timeout", "20") == 0
        assert left == ["n1"]
    got = await retained(broker)
    assert sorted(got) == [T.spec("d1"), T.assignment("n1"), T.assignment("n2")], "tombstones"
    out = capsys.readouterr().out
    assert "waiting up to 20 s for 1 member(s) to leave: n1; clearing the lost record of n2" in out
    await seen(broker, "n2")
    assert await control_async("domain", "create", "d2", "--nodes", "n2") == 0


async def test_delete_clears_a_member_whose_presence_is_its_will(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A member's Last Will is its presence, marked lost: its member record stays on the
    bus as it wrote it, and the will ends it. The delete judges the record by the will
    (lost), clears it with the rest instead of waiting for a node that will not leave,
    and the node is then free for the next domain."""
    state = domain_state("d1", ["n1", "n2"])
    state[T.presence("n2")] = presence("n2", lost=True)
    await put(broker, state)
    async with fake_agents(broker, ["n1"]) as left:
        assert await control_async("domain", "delete", "d1", "--timeout", "20") == 0
        assert left == ["n1"]
    got = await retained(broker)
    assert T.member("d1", "c1", "n2") not in got
    out = capsys.readouterr().out
    assert "waiting up to 20 s for 1 member(s) to leave: n1; clearing the lost record of n2" in out


def test_the_store_reads_a_record_its_nodes_will_ends_as_lost() -> None:
    """`Store.members` judges each member record with its node's presence: a will of the
    record's link or a later one ends it (state lost, the will's hold); a will of an
    earlier link does not; a live presence after it (the agent back) gives it back."""
    store = Store()
    topic = T.member("d1", "c1", "n2")
    record = msgspec.structs.replace(member_record("n2", 1, domain="d1"), seq=3, link=2)
    ref = TopicRef(kind="member", domain="d1", clique="c1", node="n2")
    store.apply(Received(topic, ref, record, retained=True))
    will = msgspec.json.decode(presence("n2", lost=True), type=Presence)
    pref = TopicRef(kind="presence", node="n2")
    for link, state in ((1, MemberState.MEMBER), (2, MemberState.LOST), (3, MemberState.LOST)):
        said = msgspec.structs.replace(will, link=link, hold_s=5.0)
        store.apply(Received(T.presence("n2"), pref, said, retained=True))
        assert store.members[("d1", "c1", "n2")].state is state, link
    assert store.members[("d1", "c1", "n2")].hold_s == 5.0
    back = msgspec.json.decode(presence("n2", incarnation=2), type=Presence)
    store.apply(Received(T.presence("n2"), pref, back, retained=False))
    assert store.members[("d1", "c1", "n2")] == record


async def test_delete_keeps_a_tombstone_for_static_members(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Members with no assignment (static) would rejoin: the deleting spec is kept."""
    await put(broker, domain_state("d1", ["n1"], assigned=False))
    async with fake_agents(broker, ["n1"]):
        assert await control_async("domain", "delete", "d1", "--timeout", "20") == 0
    got = await retained(broker)
    assert list(got) == [T.spec("d1")]
    assert valid("DomainSpec", got[T.spec("d1")])["state"] == "deleting"
    assert "n1 name this domain in their settings" in capsys.readouterr().out


async def test_delete_of_an_unknown_domain_changes_nothing(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Deleting what does not exist is a no-op that succeeds."""
    assert await control_async("domain", "delete", "nope") == 0
    assert await retained(broker) == {}
    assert "nothing to delete" in capsys.readouterr().out


async def test_list_shows_every_known_domain(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Domains with a spec, with members only (static), or with assignments only are listed."""
    await put(broker, domain_state("d1", ["n1", "n2", "n3"]))
    static = {
        T.member("s1", "c1", "m1"): encode(member_record("m1", 0, domain="s1")),
        T.health("s1", "m1"): encode(report("m1", 0, {0: "m1"}, domain="s1", at=time.time())),
        T.assignment("x1"): encode(Assignment(domain="later")),
    }
    await put(broker, static)
    assert await control_async("domain", "list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "DOMAIN",
        "SPEC",
        "GENERATION",
        "MAX_NODES",
        "LISTED",
        "ASSIGNED",
        "MEMBERS",
        "READY",
        "STATE",
    ]
    assert lines[1].split() == ["d1", "active", "1", "8", "3", "3", "3", "3", "UP"]
    assert lines[2].split() == ["later", "-", "-", "-", "any", "1", "0", "0", "UNKNOWN"]
    assert lines[3].split() == ["s1", "-", "-", "8", "any", "0", "1", "1", "UNKNOWN"]


def test_list_of_an_empty_bus_says_so() -> None:
    """With nothing on the bus, `domain list` says there is nothing."""
    assert "no domains" in render_list(summarize(Store(), now=NOW, report_interval_s=INTERVAL))


async def test_status_exits_0_only_when_up(broker: Mosquitto, env: dict[str, str]) -> None:
    """`imexd domain status` prints the table and exits 0 for UP, 1 for DEGRADED."""
    await put(broker, domain_state("d1", ["n1", "n2", "n3"]))
    proc = await asyncio.to_thread(imexd, "domain", "status", "d1", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("domain d1: UP, 3 of 3 members ready")
    crashed = report("n2", 1, THREE, daemon=CRASH, at=time.time())
    await put(broker, {T.health("d1", "n2"): encode(crashed)})
    proc = await asyncio.to_thread(imexd, "domain", "status", "d1", "--wait", "0", env=env)
    assert proc.returncode == 1
    assert proc.stdout.startswith("domain d1: DEGRADED, 2 of 3 members ready")
    assert "DaemonCrashLoop" in proc.stdout
    proc = await asyncio.to_thread(
        imexd, "domain", "status", "d1", "--json", "--wait", "0", env=env
    )
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["state"] == "DEGRADED"
    assert [n["node"] for n in doc["nodes"] if not n["ready"]] == ["n2"]


async def test_status_waits_for_up_within_its_wait(broker: Mosquitto, env: dict[str, str]) -> None:
    """With --wait, a domain that becomes UP meanwhile exits 0 as soon as it is UP."""
    state = domain_state("d1", ["n1", "n2", "n3"])
    starting = report("n3", 2, THREE, daemon=fx.DaemonFacts(state="STARTING"), at=time.time())
    await put(broker, state | {T.health("d1", "n3"): encode(starting)})
    proc = asyncio.create_task(
        asyncio.to_thread(imexd, "domain", "status", "d1", "--wait", "20", env=env)
    )
    await asyncio.sleep(1.5)
    await put(broker, {T.health("d1", "n3"): state[T.health("d1", "n3")]})
    started = time.monotonic()
    done = await proc
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 15
    # A prolog's log shows what it waited for: each change of the judgement, on stderr.
    assert "imexd domain status: d1 FORMING, 2 of 3 members ready" in done.stderr
    assert "waiting up to 20 s for UP" in done.stderr
    assert "imexd domain status: d1 UP" in done.stderr


async def test_ctrl_c_during_status_wait_prints_the_last_table(
    broker: Mosquitto, env: dict[str, str]
) -> None:
    """Ctrl-C while `domain status --wait` waits exits 130 with the last judgement's
    table, so whoever stopped it sees what it was waiting for."""
    state = domain_state("d1", ["n1", "n2", "n3"])
    starting = report("n3", 2, THREE, daemon=fx.DaemonFacts(state="STARTING"), at=time.time())
    await put(broker, state | {T.health("d1", "n3"): encode(starting)})
    base = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
    proc = await asyncio.create_subprocess_exec(
        IMEXD,
        "domain",
        "status",
        "d1",
        "--wait",
        "60",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**base, **env},
    )
    try:
        async with asyncio.timeout(30):
            assert proc.stderr is not None
            while b"waiting up to" not in await proc.stderr.readline():
                pass
            proc.send_signal(signal.SIGINT)
            out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 130
    assert out.decode().startswith("domain d1: FORMING, 2 of 3 members ready"), out


async def test_create_with_wait_exits_0_once_up_and_prints_the_status(
    broker: Mosquitto, env: dict[str, str]
) -> None:
    """`domain create --wait` is one prolog command: it writes the spec, then returns the
    moment the members report the domain UP, printing what `domain status` prints."""
    state = domain_state("d1", ["n1", "n2", "n3"])
    del state[T.spec("d1")]
    create = ("domain", "create", "d1", "--nodes", "n1,n2,n3", "--force", "--wait", "20")
    proc = asyncio.create_task(asyncio.to_thread(imexd, *create, env=env))
    await asyncio.sleep(1.5)
    await put(broker, state)
    done = await proc
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("domain d1: created")
    status = await asyncio.to_thread(imexd, "domain", "status", "d1", "--wait", "0", env=env)
    assert status.returncode == 0
    assert done.stdout.endswith(status.stdout)


async def test_create_with_wait_exits_1_with_the_status_when_not_up(
    broker: Mosquitto, env: dict[str, str]
) -> None:
    """At the end of --wait a domain that is not UP exits 1, its table (why) printed, the
    spec kept (the prolog deletes it)."""
    proc = await asyncio.to_thread(
        imexd, "domain", "create", "d1", "--nodes", "n1,n2", "--force", "--wait", "0.5", env=env
    )
    assert proc.returncode == 1
    assert "domain d1: created" in proc.stdout
    assert "NoReport" in proc.stdout
    assert T.spec("d1") in await retained(broker)


async def test_status_wait_returns_on_the_message_that_made_the_domain_up(
    broker: Mosquitto, env: dict[str, str]
) -> None:
    """`status --wait` judges after each message: it returns on the report that completed
    the domain, even when a second one that would also make it UP follows at once."""
    state = domain_state("d1", ["n1", "n2", "n3"])
    starting = report("n3", 2, THREE, daemon=fx.DaemonFacts(state="STARTING"), at=time.time())
    await put(broker, state | {T.health("d1", "n3"): encode(starting)})
    out, err = io.StringIO(), io.StringIO()
    settings = commands.load_control_settings(None)
    sync = f"{T.prefix}/domains/_control/sync/+"
    async with raw_client(broker) as c, asyncio.timeout(WAIT_S):
        await c.subscribe(sync, qos=1)
        command = asyncio.create_task(
            commands.status(settings, "d1", as_json=True, wait=WAIT_S, out=out, err=err)
        )
        async for message in c.messages:  # its sync echo: its snapshot is in, live from now
            if topic_matches(sync, message.topic.value):
                break
        await c.publish(T.health("d1", "n2"), state[T.health("d1", "n2")], qos=1, retain=True)
        daemon = fx.DaemonFacts(state="RUNNING", pid=102, imex_status="READY")
        first = report("n3", 2, THREE, daemon=daemon, at=time.time())
        later = report(
            "n3", 2, THREE, daemon=msgspec.structs.replace(daemon, restarts=1), at=time.time()
        )
        await asyncio.gather(
            c.publish(T.health("d1", "n3"), encode(first), qos=1, retain=True),
            c.publish(T.health("d1", "n3"), encode(later), qos=1, retain=True),
        )
        assert await command == 0, out.getvalue() + err.getvalue()
    doc = json.loads(out.getvalue())
    assert doc["state"] == "UP"
    assert [n["restarts"] for n in doc["nodes"] if n["node"] == "n3"] == [0], "the first one"


async def test_status_of_an_unknown_domain_exits_1(broker: Mosquitto, env: dict[str, str]) -> None:
    """A domain nothing is known about is an error, not an empty table."""
    proc = await asyncio.to_thread(imexd, "domain", "status", "ghost", "--wait", "0", env=env)
    assert proc.returncode == 1
    assert "domain ghost: nothing on the bus" in proc.stderr


async def _status(
    name: str, *, wait: float, nodes: list[str] | None = None
) -> tuple[int, str, str]:
    """`domain status NAME` in process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    settings = commands.load_control_settings(None)
    async with asyncio.timeout(WAIT_S):
        code = await commands.status(
            settings, name, as_json=False, wait=wait, out=out, err=err, nodes=nodes
        )
    return code, out.getvalue(), err.getvalue()


async def test_status_of_a_domain_without_a_spec_answers_at_once_and_once(
    broker: Mosquitto, env: dict[str, str]
) -> None:
    """Without a spec and without --nodes no report can make the domain UP, so status
    does not wait out its --wait: it says why once (nothing on the bus; or the table
    with NoSpec), with no "waiting" line before it."""
    code, out, err = await _status("ghost", wait=600.0)
    assert code == 1
    assert out == ""
    assert err.splitlines() == [
        "imexd: domain ghost: nothing on the bus (no spec, member record or health report)"
    ]
    state = domain_state("d1", ["n1", "n2"])
    del state[T.spec("d1")]
    await put(broker, state)
    code, out, err = await _status("d1", wait=600.0)
    assert code == 1
    assert out.startswith("domain d1: UNKNOWN, 2 of 2 members ready (no spec: "), out
    assert (out + err).count("NoSpec") == 1, out + err
    assert err == ""


async def test_status_says_where_its_members_came_from(
    broker: Mosquitto, env: dict[str, str]
) -> None:
    """The headline names the source of the member list: --nodes when given (with or
    without a spec), else the spec, else the member records."""
    state = domain_state("d1", ["n1", "n2"])
    del state[T.spec("d1")]
    await put(broker, state)
    _, out, _ = await _status("d1", wait=0.0)
    assert out.startswith(
        "domain d1: UNKNOWN, 2 of 2 members ready (no spec: members taken from their records)\n"
    )
    code, out, _ = await _status("d1", wait=0.0, nodes=["n1", "n2"])
    assert code == 0
    assert out.startswith("domain d1: UP, 2 of 2 members ready (no spec: members from --nodes)\n")
    await put(broker, {T.spec("d1"): encode(SPEC)})
    _, out, _ = await _status("d1", wait=0.0, nodes=["n1", "n2"])
    assert out.splitlines()[0].endswith(" nodes listed; members from --nodes)"), out


async def test_malformed_reports_are_ignored(broker: Mosquitto, env: dict[str, str]) -> None:
    """Garbage on a health topic neither crashes status nor counts as a member."""
    await put(broker, domain_state("d1", ["n1"]))
    await put(broker, {T.health("d1", "n2"): b"{not json", T.health("d1", "n3"): b'{"v":2}'})
    proc = await asyncio.to_thread(imexd, "domain", "status", "d1", "--wait", "0", env=env)
    assert proc.returncode == 1  # the spec lists n2 and n3, which never reported
    assert "NoReport" in proc.stdout


async def test_watch_redraws_on_change_and_stops_on_sigint(
    broker: Mosquitto, env: dict[str, str]
) -> None:
    """`--watch --json` prints a document per change; SIGINT ends it with UP's status."""
    state = domain_state("d1", ["n1", "n2", "n3"])
    crashed = report("n2", 1, THREE, daemon=CRASH, at=time.time())
    await put(broker, state | {T.health("d1", "n2"): encode(crashed)})
    base = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
    proc = await asyncio.create_subprocess_exec(
        IMEXD,
        "domain",
        "status",
        "d1",
        "--watch",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**base, **env},
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(20):
            first = json.loads(await proc.stdout.readline())
            assert first["state"] == "DEGRADED"
            await put(broker, {T.health("d1", "n2"): state[T.health("d1", "n2")]})
            second = json.loads(await proc.stdout.readline())
            assert second["state"] == "UP"
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# Errors at the broker.


def test_an_unreachable_broker_exits_1_with_a_clear_message() -> None:
    """A refused connection ends the command at once with exit 1 and names the broker."""
    url = f"mqtt://127.0.0.1:{free_port()}"
    proc = imexd("domain", "list", env={"IMEXD_BUS_URL": url})
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"imexd: cannot connect to {url}: ")
    assert "refused" in proc.stderr.lower()
    assert "check [bus] url" in proc.stderr, "where the address came from"
    assert "Traceback" not in proc.stderr


async def test_a_broker_that_never_answers_times_out() -> None:
    """A listener that accepts but never sends CONNACK fails within the connect timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"mqtt://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(BusError, match=r"no answer within 0\.5 s"):
            async with Link(BusSettings(url=(url,)), connect_timeout_s=0.5):
                pass
        assert time.monotonic() - started < 5


async def test_every_broker_is_tried_in_turn(broker: Mosquitto) -> None:
    """With several URLs the first that answers is used."""
    dead = f"mqtt://127.0.0.1:{free_port()}"
    async with Link(BusSettings(url=(dead, broker.url))) as link:
        assert link.broker == broker.url


@pytest.mark.parametrize(("protocol", "asked"), [("auto", [True]), ("3.1.1", [False])])
async def test_the_link_asks_for_the_protocol_the_settings_allow(
    broker: Mosquitto, protocol: Literal["auto", "3.1.1"], asked: list[bool]
) -> None:
    """`[bus] protocol` decides the versions the control plane tries (mqtt.protocol_versions)."""
    async with Link(BusSettings(url=(broker.url,), protocol=protocol)) as link:
        await link.read(T.specs_filter())
        assert link._client is not None
        assert [link._client.v5] == asked


async def test_a_write_the_acl_refuses_is_reported(tmp_path: Path) -> None:
    """A spec the broker silently drops (ACL) makes create exit 1 and name the topic."""
    acl = tmp_path / "acl"
    acl.write_text(
        "topic read imex/v2/#\n"
        "topic readwrite imex/v2/domains/_control/#\n"
        "topic readwrite imex/v2/nodes/+/assignment\n"
    )
    b = Mosquitto(tmp_path / "broker", extra_config=f"acl_file {acl}")
    b.start()
    try:
        proc = await asyncio.to_thread(
            imexd,
            *("domain", "create", "d1", "--nodes", "n1", "--force"),
            env={"IMEXD_BUS_URL": b.url},
        )
    finally:
        b.stop()
    assert proc.returncode == 1
    assert "did not keep our write to imex/v2/domains/d1/spec" in proc.stderr


# Refused subscriptions: a clustered broker refuses some for a while after a server died.


def settings_311(*urls: str) -> BusSettings:
    return BusSettings(url=urls, protocol="3.1.1")


async def test_a_refused_subscription_is_asked_for_again_on_the_same_broker(
    broker: Mosquitto,
) -> None:
    """A filter refused twice is granted on the third try within the operation timeout,
    on the same link: the read returns the snapshot."""
    members = T.all_members_filter("d1")
    refusing = RefusedSubscriptions({members: {1, 2}})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        async with Link(settings_311(broker.url)) as writer:
            await writer.put(T.spec("d1"), encode(SPEC))
        async with Link(settings_311(relay.url)) as link:
            store = await link.read(T.spec("d1"), members)
            assert link.broker == relay.url
            assert "d1" in store.specs
        assert refusing.refused[members] == 2
        assert relay.accepted == 1


async def test_without_the_broker_repairs_a_refusal_is_not_asked_for_again(
    broker: Mosquitto,
) -> None:
    """Asking again is a repair for a clustered NATS (`[bus] broker`); on a link that does
    not get the repairs a refusal is an ACL's: the read fails at the first refusal, naming
    the broker and the filter, instead of waiting out the operation timeout."""
    members = T.all_members_filter("d1")
    refusing = RefusedSubscriptions({members: {1, 2}})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        s = BusSettings(url=(relay.url,), protocol="3.1.1", broker="mosquitto")
        async with Link(s, timeout_s=10.0) as link:
            started = time.monotonic()
            with pytest.raises(BusError, match=f"the broker {relay.url} refused the subscription"):
                await link.read(members)
            assert time.monotonic() - started < 5.0
        assert refusing.refused[members] == 1


async def test_a_subscription_refused_for_good_moves_to_the_next_broker(
    broker: Mosquitto,
) -> None:
    """Still refused after the retries the repairs allow (`refusal_waits`) or at the end of
    the timeout, the read goes on at the next URL with every subscription of the link, its
    snapshot included."""
    members = T.all_members_filter("d1")
    refusing = RefusedSubscriptions({members: None})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        async with Link(settings_311(broker.url)) as writer:
            await writer.put(T.spec("d1"), encode(SPEC))
        async with Link(settings_311(relay.url, broker.url), timeout_s=1.0) as link:
            assert link.broker == relay.url
            store = await link.read(T.spec("d1"))
            store = await link.read(members)
            assert link.broker == broker.url
            assert "d1" in store.specs
            assert link._filters[-2:] == [T.spec("d1"), members]
            await link.sync()
        assert refusing.refused[members] >= 2


async def test_a_subscription_every_broker_refuses_names_each_and_the_filter(
    broker: Mosquitto,
) -> None:
    """When no broker grants it, the error names every broker and the filter."""
    members = T.all_members_filter("d1")
    with (
        FaultProxy(broker.host, broker.port, rule=RefusedSubscriptions({members: None})) as one,
        FaultProxy(broker.host, broker.port, rule=RefusedSubscriptions({members: None})) as two,
    ):
        async with Link(settings_311(one.url, two.url), timeout_s=0.6) as link:
            with pytest.raises(BusError) as failed:
                await link.read(members)
    message = str(failed.value)
    assert f"the broker {one.url} refused the subscription to {members}" in message
    assert f"the broker {two.url} refused the subscription to {members}" in message


async def test_after_a_write_a_refused_subscription_does_not_move_the_link(
    broker: Mosquitto,
) -> None:
    """A link that wrote stays where it wrote: a refusal then fails the command."""
    members = T.all_members_filter("d1")
    refusing = RefusedSubscriptions({members: None})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        async with Link(settings_311(relay.url, broker.url), timeout_s=0.6) as link:
            await link.put(T.spec("d1"), encode(SPEC))
            with pytest.raises(BusError, match="refused the subscription"):
                await link.read(members)
            assert link.broker == relay.url


async def test_a_retained_record_the_broker_left_out_is_read_again_on_a_repaired_link(
    broker: Mosquitto,
) -> None:
    """nats-server 2.14 leaves a retained message whose load timed out out of a new
    subscription's snapshot, without a word (`RefusedSubscriptions.skip_retained`). On a link
    that gets the broker repairs, a read subscribes again until a fresh snapshot brings
    nothing it lacked: every member record is read, and the copy read twice is logged and
    stored once."""
    members, workloads = T.all_members_filter("d1"), T.workloads_filter("d1")
    records = {T.member("d1", "c1", f"n{i}"): encode(member_record(f"n{i}", i)) for i in range(3)}
    records |= {
        T.workload("d1", w): encode(WorkloadRecord(workload=w, domain="d1", channel=c))
        for c, w in enumerate(["w0", "w1"], start=1)
    }
    await put(broker, records)
    left_out = {T.member("d1", "c1", "n1"): 1, T.workload("d1", "w1"): 1}
    refuse: dict[str, set[int] | None] = {members: set(), workloads: set()}
    refusing = RefusedSubscriptions(refuse, skip_retained=left_out)
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        async with Link(settings_311(relay.url), race=True) as link:
            store = await link.read(members, workloads)
            assert sorted(node for _, _, node in store.members) == ["n0", "n1", "n2"]
            assert sorted(logged.topic for logged in link.workload_log) == [
                T.workload("d1", "w0"),
                T.workload("d1", "w1"),
            ]
        assert refusing.skipped == 2
        # The first snapshot, the one that brought the two left out, one that brought none.
        assert refusing.seen == {members: 3, workloads: 3}


async def test_without_the_broker_repairs_a_read_subscribes_once(broker: Mosquitto) -> None:
    """Mosquitto sends a subscription's whole retained snapshot: a read there subscribes
    once and reads it all, with no second SUBSCRIBE."""
    members = T.all_members_filter("d1")
    records = {T.member("d1", "c1", f"n{i}"): member_record(f"n{i}", i) for i in range(3)}
    await put(broker, {topic: encode(record) for topic, record in records.items()})
    refusing = RefusedSubscriptions({members: set()})
    with FaultProxy(broker.host, broker.port, rule=refusing) as relay:
        s = BusSettings(url=(relay.url,), protocol="3.1.1", broker="mosquitto")
        async with Link(s) as link:
            store = await link.read(members)
            assert sorted(node for _, _, node in store.members) == ["n0", "n1", "n2"]
        assert refusing.seen[members] == 1


# Schemas.


def test_the_shipped_schemas_are_the_generated_ones() -> None:
    """docs/schemas/ holds exactly what imexd.messages.json_schemas() generates."""
    assert outdated_schemas(SCHEMAS) == []
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == sorted(schema_texts())
    for name, schema in json_schemas().items():
        assert json.loads((SCHEMAS / f"{name}.json").read_text()) == schema


def test_the_schema_check_fails_on_a_stale_copy(tmp_path: Path) -> None:
    """`imexd schemas --check` exits 1 when a file differs."""
    gen = imexd("schemas", "--write", str(tmp_path))
    assert gen.returncode == 0, gen.stderr
    (tmp_path / "DomainSpec.json").write_text("{}\n")
    check = imexd("schemas", "--check", str(tmp_path))
    assert check.returncode == 1
    assert "DomainSpec.json" in check.stderr


def test_the_payload_types_and_the_schemas_agree() -> None:
    """What the wire types encode validates, and what the schemas reject does not decode."""
    spec = json.loads(encode(SPEC))
    validator("DomainSpec").validate(spec)
    validator("MemberRecord").validate(json.loads(encode(member_record("n1", 0))))
    validator("HealthReport").validate(json.loads(encode(report("n1", 0, THREE))))
    validator("Assignment").validate({"v": 1, "domain": None})
    assert not validator("DomainSpec").is_valid({**spec, "state": "gone"})
    assert not validator("Assignment").is_valid({"domain": "d1"})


def test_the_parser_default_of_seen_within_is_the_commands() -> None:
    """`--seen-within`'s default in the parser (which must not import the control plane)
    is commands.SEEN_WITHIN_S, for `domain create` and `node assign` alike."""
    parser = build_parser()
    for argv in (["domain", "create", "d1"], ["node", "assign", "n1", "d1"]):
        assert parser.parse_args(argv).seen_within == commands.SEEN_WITHIN_S
    assert SEEN_WITHIN_DEFAULT_S == commands.SEEN_WITHIN_S


async def test_list_warns_when_a_spec_lists_a_live_member_of_another_domain(
    broker: Mosquitto, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A spec listing a node that holds a live member record in another domain: `domain
    list` names both on stderr (the node stays out of the spec's domain); a lost record
    (a dead node's will) is no warning."""
    await put(broker, domain_state("d1", ["n1", "n2"]))
    await put(broker, {T.spec("d2"): encode(DomainSpec(domain="d2", nodes=["n2", "n3"]))})
    lost = msgspec.structs.replace(
        member_record("n3", 0, domain="d9"), state=MemberState.LOST, slot=None
    )
    await put(broker, {T.member("d9", "c1", "n3"): encode(lost)})
    capsys.readouterr()
    assert await control_async("domain", "list") == 0
    err = capsys.readouterr().err
    assert "warning: the spec of d2 lists n2, a member of d1" in err
    assert "n3" not in err


def test_the_state_table_has_every_state_a_domain_is_shown_in() -> None:
    """docs/control-plane.md's table of domain states has one row for each state that
    `domain status` judges and for LEAVING, the demo's headline while its agents stop
    (`imexd.demo.scenario.Demo.verdict`), and none more."""
    doc = (REPO / "docs" / "control-plane.md").read_text()
    table = doc.split("| state | when |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    assert '"LEAVING"' in inspect.getsource(Demo.verdict)
    assert sorted(rows) == sorted([*get_args(DomainState), "LEAVING"])
