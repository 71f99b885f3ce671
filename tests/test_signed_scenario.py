"""Signed control-plane records with real agents (tests/cluster.py: `imexd run` processes,
simulated IMEX daemons, a real Mosquitto).

The agents have `[control] public_key`, the control plane (`imexd domain|workload ...`
subprocesses) the private key. What the control plane writes drives the fleet as before;
what a raw client forges on the same topics (a spec marked deleting without a signature,
or signed with another key; a clear of an assignment or of a workload) changes nothing:
no daemon stopped or restarted, no channel removed, each counted and said by
BusConnected. Without a key on the agents, signed records are taken like unsigned ones.
Every wait is bounded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from imexd.messages import DomainSpec, encode
from imexd.signing import Signer, create_keys
from tests.cluster import Cluster, Node, formed, pids, untouched
from tests.support import during

pytestmark = pytest.mark.slow

NAMES = ["n1", "n2", "n3"]
SPEC = "imex/v2/domains/d1/spec"
WATCH_S = 4.0
"""How long a wrong reaction gets to show (reconcile, reload window, probes)."""
CHANNELS: dict[str, dict[str, Any]] = {"channels": {"simulate": True}}
"""A stand-in channel file where the agent may not mknod (the test may run unprivileged)."""


def keyed(c: Cluster, tmp_path: Path) -> tuple[list[Node], dict[str, str], str]:
    """n1..n3 idle in assigned mode with the public key; the control plane's keys, as the
    variables of its environment; the key's fingerprint."""
    private, public, fingerprint = create_keys(tmp_path / "keys")
    overrides: dict[str, dict[str, Any]] = {"control": {"public_key": str(public)}, **CHANNELS}
    nodes = [c.add(name, domain=None, overrides=overrides) for name in NAMES]
    c.wait(c.all_ready, timeout=60, what="idle nodes ready")
    keys = {
        "IMEXD_CONTROL_PRIVATE_KEY": str(private),
        "IMEXD_CONTROL_PUBLIC_KEY": str(public),
    }
    return nodes, keys, fingerprint


def steady(nodes: list[Node], before: dict[str, int | None]) -> list[str]:
    """Watch for WATCH_S: every agent alive, every daemon the one it was."""

    def check() -> str | None:
        for n in nodes:
            if not n.alive():
                return f"{n.name}: the agent exited"
            if n.daemon_pids_on_host() != [before[n.name]]:
                return f"{n.name}: daemons {n.daemon_pids_on_host()}, was {before[n.name]}"
        return None

    return during(WATCH_S, check)


def grown(node: Node, counts: dict[str, float], reason: str) -> float:
    return node.dropped().get(reason, 0) - counts.get(reason, 0)


def test_signed_records_drive_the_fleet_and_forged_ones_change_nothing(
    c: Cluster, tmp_path: Path
) -> None:
    """`domain create --wait` and `workload create --wait` work signed; a forged deleting
    spec (unsigned, then signed with another key) and forged clears of an assignment and
    of the workload stop no daemon and remove no channel; the forgeries are counted by
    reason and named by BusConnected UnverifiedRecords, the clears given back at once by
    the agents; the control plane's signed delete still ends it."""
    nodes, keys, fingerprint = keyed(c, tmp_path)
    created = c.imexd(
        "domain", "create", "d1", "--nodes", ",".join(NAMES), "--wait", "60", env=keys
    )
    assert created.returncode == 0, created.stdout + created.stderr
    formed(c, nodes)
    work = c.imexd("workload", "create", "w1", "--domain", "d1", "--wait", "30", env=keys)
    assert work.returncode == 0, work.stdout + work.stderr
    channel = next(
        w["channel"] for w in nodes[0].status()["channels"]["workloads"] if w["workload"] == "w1"
    )
    devices = [n.dev_dir / f"channel{channel}" for n in nodes]
    assert all(d.exists() for d in devices)
    for n in nodes:
        status = n.status()
        assert status["control_key"] == fingerprint, n.name
        assert n.condition("BusConnected")["reason"] == "Connected", n.name
    shown = c.imexd("status", "--url", nodes[0].url, env=keys)
    assert f"records verified with key {fingerprint}" in shown.stdout

    before = pids(nodes)
    counts = {n.name: n.dropped() for n in nodes}
    cleared = ("imex/v2/nodes/n1/assignment", "imex/v2/domains/d1/workloads/w1")
    with c.client() as client:
        signed = {t: client.retained(t)[t] for t in cleared}
    deleting = encode(DomainSpec(domain="d1", nodes=["n9"], max_nodes=8, state="deleting",
                                 generation=99))  # fmt: skip
    other = Signer(Ed25519PrivateKey.generate())
    with c.client() as client:
        client.publish(SPEC, deleting, retain=True)
        client.publish(SPEC, other.seal(SPEC, deleting), retain=True)
        client.publish("imex/v2/nodes/n1/assignment", b"", retain=True)
        client.publish("imex/v2/domains/d1/workloads/w1", b"", retain=True)
    problems = steady(nodes, before)
    problems += untouched(nodes, before)
    problems += [f"{d} removed" for d in devices if not d.exists()]
    for n in nodes:
        for reason in ("unsigned", "signature"):
            if grown(n, counts[n.name], reason) < 1:
                problems.append(f"{n.name}: no {reason} drop counted")
        cond = n.condition("BusConnected")
        if (cond.get("status"), cond.get("reason")) != ("True", "UnverifiedRecords"):
            problems.append(f"{n.name}: BusConnected {cond}")
        elif SPEC not in cond["message"]:
            problems.append(f"{n.name}: BusConnected names no spec: {cond['message']}")
        if not n.ready():
            problems.append(f"{n.name}: not ready")
    assert problems == [], problems

    def given_back() -> bool:
        with c.client() as client:
            return all(client.retained(t).get(t) == signed[t] for t in cleared)

    # A clear removes nothing: the agents that hold the records publish them again.
    c.wait(given_back, timeout=10, what="the cleared assignment and workload given back")

    # The signed delete ends it all. n1 keeps the assignment the forged clear took off
    # the broker (the control plane no longer sees it), so it stays pointed at d1, out.
    deleted = c.imexd("domain", "delete", "d1", "--wait", "60", env=keys)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    c.wait(
        lambda: (
            all(n.daemon_pids_on_host() == [] for n in nodes)
            and not any(d.exists() for d in devices)
        ),
        timeout=60,
        what="every daemon stopped and every channel removed after the signed delete",
    )
    c.wait(
        lambda: all(n.status().get("domain") is None for n in nodes[1:]),
        timeout=30,
        what="n2 and n3 idle (their signed assignments to no domain)",
    )


def test_agents_without_the_key_take_signed_records(c: Cluster, tmp_path: Path) -> None:
    """A control plane that signs drives agents that do not verify (a fleet given the key
    in that order): `domain create --wait` works, and `imexd status` says that records are
    accepted unsigned."""
    private, _, _ = create_keys(tmp_path / "keys")
    nodes = [c.add(name, domain=None) for name in NAMES[:2]]
    c.wait(c.all_ready, timeout=60, what="idle nodes ready")
    keys = {"IMEXD_CONTROL_PRIVATE_KEY": str(private)}
    created = c.imexd("domain", "create", "d1", "--nodes", "n1,n2", "--wait", "60", env=keys)
    assert created.returncode == 0, created.stdout + created.stderr
    with c.client() as client:
        spec = client.retained(SPEC)[SPEC]
    assert "sig" in json.loads(spec)
    for n in nodes:
        assert n.status()["control_key"] == "", n.name
    shown = c.imexd("status", "--url", nodes[0].url, env=keys)
    assert "records accepted unsigned (no control.public_key)" in shown.stdout
    assert c.imexd("domain", "delete", "d1", "--wait", "60", env=keys).returncode == 0
