"""The control plane with `[control] private_key` against a real Mosquitto: every spec,
workload, assignment and retry request it writes verifies with the public key; its
deletions reach agents as signed records before any clear; with `[control] public_key`
it reads only what verifies. Commands run in-process (`imexd.cli.main` in a worker
thread), what they leave on the broker is read back with a raw client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from imexd.cli.main import main
from imexd.messages import DomainSpec, Presence, encode
from imexd.signing import Verifier, create_keys, load_verifier
from imexd.topics import Topics
from tests.brokers import Mosquitto
from tests.reports import CRASH, report
from tests.support import raw_client, until
from tests.test_control import put, retained, valid

T = Topics("imex/v2")
WAIT_S = 10.0


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    private, public, _ = create_keys(tmp_path / "keys")
    return private, public


@pytest.fixture
def env(
    broker: Mosquitto, monkeypatch: pytest.MonkeyPatch, keys: tuple[Path, Path]
) -> dict[str, str]:
    """A control plane that reaches `broker` with no settings file and signs with the
    private key of `keys`."""
    for name in list(os.environ):
        if name.startswith("IMEXD_"):
            monkeypatch.delenv(name)
    values = {
        "IMEXD_BUS_URL": broker.url,
        "IMEXD_DOMAIN_MAX_NODES": "8",
        "IMEXD_CONTROL_PRIVATE_KEY": str(keys[0]),
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


async def cli(*args: str) -> int:
    """`imexd ARGS` in a worker thread (its own event loop)."""
    return await asyncio.to_thread(main, list(args))


@contextlib.asynccontextmanager
async def recording(broker: Mosquitto, topic_filter: str) -> AsyncIterator[list[tuple[str, bytes]]]:
    """Every live message on `topic_filter` while inside, in the broker's order."""
    seen: list[tuple[str, bytes]] = []
    async with raw_client(broker) as c:
        await c.subscribe(topic_filter, qos=1)

        async def read() -> None:
            async for message in c.messages:
                if not message.retain:
                    payload = message.payload
                    seen.append(
                        (message.topic.value, payload if isinstance(payload, bytes) else b"")
                    )

        task = asyncio.create_task(read())
        try:
            yield seen
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def verified(verifier: Verifier, got: dict[str, bytes]) -> dict[str, str]:
    """Each record's verdict: "ok" or the problem's reason."""
    out: dict[str, str] = {}
    for topic, data in got.items():
        problem = verifier.problem(topic, data)
        out[topic] = "ok" if problem is None else problem[0]
    return out


async def test_create_writes_a_signed_spec_and_signed_assignments(
    broker: Mosquitto, env: dict[str, str], keys: tuple[Path, Path]
) -> None:
    """`domain create --nodes` with a private key: the spec and both assignments verify with
    the public key on their topics and still validate against the shipped schemas."""
    assert await cli("domain", "create", "d1", "--nodes", "n1,n2", "--force") == 0
    got = await retained(broker)
    v = load_verifier(str(keys[1]))
    assert verified(v, got) == {
        T.spec("d1"): "ok",
        T.assignment("n1"): "ok",
        T.assignment("n2"): "ok",
    }
    spec = valid("DomainSpec", got[T.spec("d1")])
    assert len(spec["sig"]) == 86
    valid("Assignment", got[T.assignment("n1")])


async def test_unassign_writes_a_signed_assignment_to_no_domain(
    broker: Mosquitto, env: dict[str, str], keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node unassign` writes the assignment's tombstone, one to no domain: signed with a
    key, unsigned without."""
    assert await cli("node", "assign", "n1", "d1", "--force") == 0
    assert await cli("node", "unassign", "n1") == 0
    got = await retained(broker, T.assignment("n1"))
    assert json.loads(got[T.assignment("n1")])["domain"] is None
    assert load_verifier(str(keys[1])).problem(T.assignment("n1"), got[T.assignment("n1")]) is None
    monkeypatch.delenv("IMEXD_CONTROL_PRIVATE_KEY")
    assert await cli("node", "assign", "n2", "d1", "--force") == 0
    assert await cli("node", "unassign", "n2") == 0
    unsigned = (await retained(broker))[T.assignment("n2")]
    assert json.loads(unsigned)["domain"] is None
    assert b'"sig"' not in unsigned


async def test_a_workload_is_created_signed_and_deleted_through_a_signed_tombstone(
    broker: Mosquitto, env: dict[str, str], keys: tuple[Path, Path]
) -> None:
    """`workload create` (its channel claim and the active record) writes signed records;
    `workload delete` writes a signed tombstone (`deleted` on no node, one generation up)
    and no clear."""
    v = load_verifier(str(keys[1]))
    topic = T.workload("d1", "w1")
    async with recording(broker, T.workloads_filter("d1")) as seen:
        assert await cli("workload", "create", "w1", "--domain", "d1", "--wait", "0") == 0
        record = valid("WorkloadRecord", (await retained(broker, topic))[topic])
        assert record["state"] == "active"
        assert await cli("workload", "delete", "w1", "--domain", "d1", "--wait", "0") == 0
        await until(lambda: len(seen) >= 3, within=WAIT_S)
    assert [t for t, _ in seen] == [topic] * 3
    claim, active, retired = (data for _, data in seen)
    for data in (claim, active, retired):
        assert v.problem(topic, data) is None
    assert json.loads(claim)["state"] == "claiming"
    assert json.loads(claim)["generation"] + 1 == record["generation"]
    gone = json.loads(retired)
    assert (gone["state"], gone["nodes"]) == ("deleted", [])
    assert gone["generation"] == record["generation"] + 1
    assert gone["channel"] == record["channel"]
    assert (await retained(broker))[topic] == retired


async def test_delete_writes_signed_tombstones(
    broker: Mosquitto, env: dict[str, str], keys: tuple[Path, Path]
) -> None:
    """`domain delete` with a key: the spec goes `deleting` then `deleted`, each workload
    `deleted` and each assignment to no domain, all signed; nothing is cleared."""
    v = load_verifier(str(keys[1]))
    assert await cli("domain", "create", "d1", "--nodes", "n1", "--force") == 0
    assert await cli("workload", "create", "w1", "--domain", "d1", "--wait", "0") == 0
    async with recording(broker, "imex/v2/#") as seen:
        assert await cli("domain", "delete", "d1", "--wait", "2") == 0
        await until(
            lambda: any(t == T.assignment("n1") and b"null" in p for t, p in seen), within=WAIT_S
        )
    ours = [(t, p) for t, p in seen if "/_control/" not in t]
    spec = [p for t, p in ours if t == T.spec("d1")]
    assert [json.loads(p)["state"] for p in spec] == ["deleting", "deleted"]
    work = [p for t, p in ours if t == T.workload("d1", "w1")]
    assert [(json.loads(p)["state"], json.loads(p)["nodes"]) for p in work] == [("deleted", [])]
    assert all(p for t, p in ours if "/members/" not in t and "/health/" not in t), "no clear"
    left = await retained(broker)
    assert verified(v, left) == {
        T.assignment("n1"): "ok",
        T.spec("d1"): "ok",
        T.workload("d1", "w1"): "ok",
    }
    assert json.loads(left[T.assignment("n1")])["domain"] is None


async def test_with_a_public_key_the_control_plane_reads_only_what_verifies(
    broker: Mosquitto,
    env: dict[str, str],
    keys: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With `[control] public_key` an unsigned spec is not read (`domain list` does not
    show it) while a signed one is; without it both are, as before."""
    assert await cli("domain", "create", "d1", "--force") == 0
    forged = DomainSpec(domain="d2", nodes=["x1"], generation=99)
    await put(broker, {T.spec("d2"): encode(forged)})
    capsys.readouterr()
    assert await cli("domain", "list") == 0
    assert "d2" in capsys.readouterr().out
    monkeypatch.setenv("IMEXD_CONTROL_PUBLIC_KEY", str(keys[1]))
    assert await cli("domain", "list") == 0
    out = capsys.readouterr().out
    assert "d1" in out
    assert "d2" not in out


async def test_a_public_key_without_the_private_key_writes_nothing(
    broker: Mosquitto,
    env: dict[str, str],
    keys: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A control plane that verifies but cannot sign refuses to write a record its own
    reads (and the agents) would drop: exit 2 naming the key, nothing on the broker."""
    monkeypatch.delenv("IMEXD_CONTROL_PRIVATE_KEY")
    monkeypatch.setenv("IMEXD_CONTROL_PUBLIC_KEY", str(keys[1]))
    assert await cli("domain", "create", "d1", "--force") == 2
    assert "control.private_key: expected a key where control.public_key is set" in (
        capsys.readouterr().err
    )
    assert await retained(broker) == {}


async def test_a_retry_request_is_signed_and_its_tombstone_follows(
    broker: Mosquitto, env: dict[str, str], keys: tuple[Path, Path]
) -> None:
    """`node retry` with a key writes a signed request under the node's domain, and when
    it ends its signed tombstone (`done`, one generation up)."""
    now = time.time()
    presence = Presence(node="n1", incarnation=1, at=now, domain="d1", address="127.0.0.10")
    crashed = report("n1", 0, {0: "n1"}, at=now, daemon=CRASH)
    await put(broker, {T.presence("n1"): encode(presence), T.health("d1", "n1"): encode(crashed)})
    topic = T.retry("d1", "n1")
    async with recording(broker, topic) as seen:
        assert await cli("node", "retry", "n1", "--wait", "0.5") == 1
        await until(lambda: len(seen) >= 2, within=WAIT_S)
    (_, request), (_, done) = seen
    v = load_verifier(str(keys[1]))
    assert v.problem(topic, request) is None
    assert v.problem(topic, done) is None
    assert json.loads(request)["node"] == "n1"
    assert json.loads(done)["state"] == "done"
    assert json.loads(done)["generation"] == json.loads(request)["generation"] + 1
