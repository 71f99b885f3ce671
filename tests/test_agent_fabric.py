"""The agent with `[node] clique = "auto"`: NVML discovery runs in a child it survives."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.cluster import Cluster, spawn_agent

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "fixtures" / "fabric" / "h200_child.json"
UUID_HEX = "4fe1c2d3a4b5c6d7e8f9a0b1c2d3e4f5"
CLIQUE = "4fe1c2d3-a4b5-c6d7-e8f9-a0b1c2d3e4f5.7"


def _start_with_child(c: Cluster, name: str, child: Path) -> None:
    """Start an agent whose NVML child is the given script (auto clique)."""
    node = c.add(name, clique="auto", start=False)
    env = {"IMEXD_FABRIC_CHILD_CMD": f"{sys.executable} {child}"}
    node.proc = spawn_agent(node.config_path, node.log_path, env=env)


def _condition(status: dict[str, object], kind: str) -> dict[str, str]:
    conditions = status.get("conditions", [])
    assert isinstance(conditions, list)
    missing = {"type": kind, "status": "Unknown", "reason": "", "message": ""}
    return next((c for c in conditions if c["type"] == kind), missing)


def test_crashing_nvml_child_is_reported_and_survived(c: Cluster, tmp_path: Path) -> None:
    """A discovery child that dies of SIGSEGV leaves the agent alive and says why."""
    child = tmp_path / "segv.py"
    child.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    _start_with_child(c, "n1", child)
    node = c.nodes["n1"]
    c.wait(lambda: "SIGSEGV" in _condition(node.status(), "FabricReady")["message"])
    fabric = _condition(node.status(), "FabricReady")
    assert fabric["status"] == "False"
    assert fabric["reason"] == "DiscoveryFailed"
    assert "clique" in fabric["message"]
    assert node.get("/healthz")[0] == 200
    assert node.get("/readyz")[0] == 503
    assert node.alive()


def test_discovered_clique_places_the_node_in_its_shard(c: Cluster, tmp_path: Path) -> None:
    """A fabric report with a completed clique makes the node a member of that clique."""
    doc = json.loads(FIXTURE.read_text())
    doc["gpus"][0]["fabric"].update(state=3, status=0, cluster_uuid=UUID_HEX, clique_id=7)
    child = tmp_path / "ok.py"
    child.write_text(f"print({json.dumps(json.dumps(doc))})\n")
    _start_with_child(c, "n1", child)
    node = c.nodes["n1"]
    c.wait(node.ready, timeout=40)
    status = node.status()
    assert status["clique"] == CLIQUE
    assert status["driver"] == "580.159.04"
    assert _condition(status, "FabricReady")["status"] == "True"
    assert node.hosts_slots()[status["slot"]] == node.address
