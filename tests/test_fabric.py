"""Tests of imexd.fabric: the clique rule (pure), the NVML child protocol, the CLI.

NVML itself is absent here; fake children stand in for crashing, hanging, babbling and
well-behaved NVML, and a fake pynvml module checks how the child calls the fabric API.
tests/fixtures/fabric holds the real output of a single-GPU H200 (driver 580.159.04).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shlex
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from imexd.cli.main import main
from imexd.errors import DiscoveryError
from imexd.fabric import (
    CHILD_CMD_ENV,
    PLAIN_API,
    VERSIONED_API,
    Discovery,
    FabricState,
    GpuFabric,
    _child_fabric,
    _FabricInfo,
    _FabricInfoV2,
    child_command,
    clique_from_fabric,
    collect_fabric,
    collect_health,
    discover,
    report_from_json,
    with_health,
)

FIXTURES = Path(__file__).parent / "fixtures" / "fabric"
IMEXD = str(Path(sys.executable).parent / "imexd")
CLUSTER = bytes.fromhex("0123456789ABCDEF0123456789abcdef")
OTHER_CLUSTER = bytes.fromhex("fedcba98765432100123456789abcdef")


def _has_nvml() -> bool:
    """Whether libnvidia-ml loads here (as pynvml loads it); nothing is called in it."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


HAS_NVML = _has_nvml()


def gpu(
    index: int,
    *,
    state: int | None = FabricState.COMPLETED,
    status: int = 0,
    cluster: bytes = CLUSTER,
    clique: int = 7,
    error: str | None = None,
) -> GpuFabric:
    return GpuFabric(
        index=index,
        uuid=f"GPU-{index:08x}-0000-0000-0000-000000000000",
        name="NVIDIA GB200",
        state=state,
        status=status,
        cluster_uuid=cluster,
        clique_id=clique,
        error=error,
    )


# The clique rule.


def test_all_gpus_agree() -> None:
    """Four GPUs COMPLETED/SUCCESS in one clique give `<uuid 8-4-4-4-12>.<cliqueId>`."""
    result = clique_from_fabric([gpu(i) for i in range(4)])
    assert result.clique == "01234567-89ab-cdef-0123-456789abcdef.7"
    assert result.reason == f"all 4 GPUs in clique {result.clique}"


def test_zero_cluster_uuid_means_no_multinode_nvlink() -> None:
    """COMPLETED with an all-zero UUID (an H100 HGX) is no multi-node NVLink."""
    result = clique_from_fabric([gpu(i, cluster=bytes(16), clique=0) for i in range(8)])
    assert result.clique == ""
    assert "all zero" in result.reason


def test_not_supported_state() -> None:
    """Fabric state NOT_SUPPORTED (as on a single H200) is no multi-node NVLink."""
    result = clique_from_fabric([gpu(0, state=FabricState.NOT_SUPPORTED, cluster=bytes(16))])
    assert result.clique == ""
    assert "GPU 0" in result.reason
    assert "NOT_SUPPORTED" in result.reason


def test_not_supported_error() -> None:
    """NVML's NOT_SUPPORTED error from the fabric call is no multi-node NVLink."""
    result = clique_from_fabric([gpu(0, state=None, error="NOT_SUPPORTED")])
    assert result.clique == ""
    assert "NOT_SUPPORTED" in result.reason


def test_mixed_kinds_of_no_nvlink() -> None:
    """GPUs that each lack multi-node NVLink in different ways still agree on ""."""
    result = clique_from_fabric(
        [
            gpu(0, state=FabricState.NOT_SUPPORTED),
            gpu(1, state=None, error="NOT_SUPPORTED"),
            gpu(2, cluster=bytes(16)),
        ]
    )
    assert result.clique == ""


def test_no_gpus() -> None:
    """A node without GPUs has no NVLink: "" with the reason "no GPUs"."""
    result = clique_from_fabric([])
    assert result.clique == ""
    assert result.reason.startswith("no GPUs")


@pytest.mark.parametrize("state", [FabricState.NOT_STARTED, FabricState.IN_PROGRESS])
def test_fabric_not_finished_is_an_error(state: FabricState) -> None:
    """A fabric registration NOT_STARTED or IN_PROGRESS is an error naming the GPU."""
    with pytest.raises(DiscoveryError, match=state.name) as info:
        clique_from_fabric([gpu(0), gpu(1, state=state)])
    assert "GPU 1 (GPU-00000001" in str(info.value)
    assert "GPU 0" not in str(info.value)


def test_completed_with_failure_status_is_an_error() -> None:
    """COMPLETED with a non-SUCCESS status is an error naming the status."""
    with pytest.raises(DiscoveryError, match=r"GPU 2 .*status TIMEOUT"):
        clique_from_fabric([gpu(0), gpu(1), gpu(2, status=10)])


def test_other_nvml_error_and_unknown_state_are_errors() -> None:
    """An NVML error other than NOT_SUPPORTED, or an unknown state, is an error."""
    with pytest.raises(DiscoveryError, match="GPU_IS_LOST"):
        clique_from_fabric([gpu(0, state=None, error="GPU_IS_LOST")])
    with pytest.raises(DiscoveryError, match=r"UNKNOWN\(7\)"):
        clique_from_fabric([gpu(0, state=7)])


def test_different_cluster_uuids_disagree() -> None:
    """GPUs in different clusters are a disagreement naming both cliques."""
    with pytest.raises(DiscoveryError, match="disagree") as info:
        clique_from_fabric([gpu(0), gpu(1, cluster=OTHER_CLUSTER)])
    message = str(info.value)
    assert "01234567-89ab-cdef-0123-456789abcdef.7" in message
    assert "fedcba98-7654-3210-0123-456789abcdef.7" in message


def test_different_clique_ids_disagree() -> None:
    """GPUs in different cliques of one cluster are a disagreement, grouped by clique."""
    with pytest.raises(DiscoveryError, match="disagree") as info:
        clique_from_fabric([gpu(0), gpu(1), gpu(2, clique=8)])
    message = str(info.value)
    assert "GPU 0 (GPU-00000000-0000-0000-0000-000000000000), GPU 1" in message
    assert message.endswith("clique 01234567-89ab-cdef-0123-456789abcdef.8")


def test_mixed_supported_and_unsupported_disagree() -> None:
    """Some GPUs in a clique and some without multi-node NVLink is a disagreement."""
    with pytest.raises(DiscoveryError, match="disagree") as info:
        clique_from_fabric([gpu(0), gpu(1, state=FabricState.NOT_SUPPORTED)])
    assert "no multi-node NVLink (fabric state NOT_SUPPORTED)" in str(info.value)


def test_errors_take_precedence_and_all_bad_gpus_are_named() -> None:
    """With several problems, every failing GPU is listed."""
    with pytest.raises(DiscoveryError) as info:
        clique_from_fabric(
            [gpu(0, state=FabricState.IN_PROGRESS), gpu(1, status=3), gpu(2, clique=9)]
        )
    assert "GPU 0" in str(info.value)
    assert "GPU 1" in str(info.value)
    assert "disagree" not in str(info.value)


# How the child calls NVML (a fake pynvml module).


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


def fake_pynvml(**functions: Callable[[Any, Any], None]) -> Any:
    return types.SimpleNamespace(NVMLError=FakeNVMLError, **functions)


def test_child_uses_the_plain_call_by_reference() -> None:
    """The plain call gets a pointer to a 28-byte nvmlGpuFabricInfo_t and its fields are read."""
    seen: list[Any] = []

    def plain(handle: Any, ref: Any) -> None:
        assert type(ref).__name__ == "CArgObject", "the structure must go by reference"
        info = ref._obj
        assert ctypes.sizeof(info) == 28
        ctypes.memmove(info.clusterUuid, CLUSTER, 16)
        info.status, info.cliqueId, info.state = 0, 32766, 3
        seen.append(handle)

    def versioned(handle: Any, ref: Any) -> None:
        raise AssertionError("the versioned call must not be used when the plain one works")

    fields, api = _child_fabric(
        fake_pynvml(nvmlDeviceGetGpuFabricInfo=plain, nvmlDeviceGetGpuFabricInfoV=versioned),
        "handle-0",
    )
    assert seen == ["handle-0"]
    assert api == PLAIN_API
    assert fields == {
        "state": 3,
        "status": 0,
        "cluster_uuid": CLUSTER.hex(),
        "clique_id": 32766,
        "health_mask": None,
        "error": None,
    }


def test_child_falls_back_to_versioned_call_only_when_plain_is_absent() -> None:
    """Without the plain call (or FUNCTION_NOT_FOUND), the V call gets version 0x02000024."""

    def versioned(handle: Any, ref: Any) -> None:
        info = ref._obj
        assert info.version == 0x02000024
        assert ctypes.sizeof(info) == 36
        info.state, info.healthMask = 0, 0x155

    def gone(handle: Any, ref: Any) -> None:
        raise FakeNVMLError(13)

    for module in (
        fake_pynvml(nvmlDeviceGetGpuFabricInfoV=versioned),
        fake_pynvml(nvmlDeviceGetGpuFabricInfo=gone, nvmlDeviceGetGpuFabricInfoV=versioned),
    ):
        fields, api = _child_fabric(module, "h")
        assert api == VERSIONED_API
        assert (fields["state"], fields["health_mask"]) == (0, 0x155)


def test_child_reports_nvml_errors_by_name() -> None:
    """An NVML error from the fabric call is recorded by name, not raised."""

    def unsupported(handle: Any, ref: Any) -> None:
        raise FakeNVMLError(3)

    fields, _ = _child_fabric(fake_pynvml(nvmlDeviceGetGpuFabricInfo=unsupported), "h")
    assert fields == {"error": "NOT_SUPPORTED"}
    fields, api = _child_fabric(fake_pynvml(), "h")
    assert (fields, api) == ({"error": "FUNCTION_NOT_FOUND"}, "")


def test_own_structures_match_nvml_h() -> None:
    """imexd's structures have nvml.h's sizes, whatever pynvml declares."""
    assert ctypes.sizeof(_FabricInfo) == 28
    assert _FabricInfo.state.offset == 24
    assert ctypes.sizeof(_FabricInfoV2) == 36
    assert _FabricInfoV2.healthMask.offset == 32


# The child's report.


def test_h200_report_and_discover_document() -> None:
    """The real H200 child output yields "" and exactly the recorded discover JSON."""
    report = report_from_json(json.loads((FIXTURES / "h200_child.json").read_text()))
    assert report.driver_version == "580.159.04"
    assert report.nvml_version == "13.580.159.04"
    assert report.fabric_api == PLAIN_API
    (only,) = report.gpus
    assert (only.index, only.name, only.state, only.cluster_uuid) == (
        0,
        "NVIDIA H200",
        FabricState.NOT_SUPPORTED,
        bytes(16),
    )
    result = clique_from_fabric(report.gpus)
    document = {**report.to_json(), "clique": result.clique, "reason": result.reason}
    assert document == json.loads((FIXTURES / "h200_discover.json").read_text())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("gpus"),
        lambda d: d.update(gpus={}),
        lambda d: d.update(driver_version=580),
        lambda d: d["gpus"][0].update(index="0"),
        lambda d: d["gpus"][0].update(index=True),
        lambda d: d["gpus"][0].pop("fabric"),
        lambda d: d["gpus"][0]["fabric"].update(state="COMPLETED"),
        lambda d: d["gpus"][0]["fabric"].update(cluster_uuid="zz"),
        lambda d: d["gpus"][0]["fabric"].update(cluster_uuid="00" * 80),
        lambda d: d["gpus"][0]["fabric"].update(error=3),
        lambda d: d["gpus"][0]["fabric"].update(health_mask="x"),
        lambda d: d["gpus"].append("GPU-1"),
    ],
)
def test_report_with_wrong_shape(mutate: Callable[[dict[str, Any]], object]) -> None:
    """A child report of the wrong shape (e.g. an 80-byte UUID) is a DiscoveryError."""
    doc = json.loads((FIXTURES / "h200_child.json").read_text())
    mutate(doc)
    with pytest.raises(DiscoveryError, match="unexpected report"):
        report_from_json(doc)


# The parent against fake children.


def _child(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "child.py"
    path.write_text(body)
    return [sys.executable, str(path)]


def _report(gpus: list[GpuFabric]) -> str:
    return json.dumps(
        {
            "v": 1,
            "driver_version": "570.172.08",
            "nvml_version": "12.570.172.08",
            "gpus": [
                {
                    **g.to_json(),
                    "fabric_api": PLAIN_API,
                    "fabric": {
                        "state": g.state,
                        "status": g.status,
                        "cluster_uuid": g.cluster_uuid.hex(),
                        "clique_id": g.clique_id,
                        "health_mask": None,
                        "error": None,
                    },
                }
                for g in gpus
            ],
        }
    )


SEGFAULT = (
    "import os, resource, signal\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "print('calling nvmlDeviceGetGpuFabricInfoV', flush=True)\n"
    "os.kill(os.getpid(), signal.SIGSEGV)\n"
)


async def test_child_segfault_is_a_clear_error(tmp_path: Path) -> None:
    """A child killed by SIGSEGV is a DiscoveryError saying so and naming the setting."""
    with pytest.raises(DiscoveryError) as info:
        await discover(10, child_cmd=_child(tmp_path, SEGFAULT))
    message = str(info.value)
    assert "NVML child died with SIGSEGV" in message
    assert "IMEXD_NODE_CLIQUE" in message


async def test_child_hang_is_killed(tmp_path: Path) -> None:
    """A hung child is killed and reaped at the timeout; the error says it timed out."""
    pid_file = tmp_path / "pid"
    hang = (
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    )
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match=r"timed out after 1 s"):
        await discover(1, child_cmd=_child(tmp_path, hang))
    assert time.monotonic() - started < 2.5
    assert not psutil.pid_exists(int(pid_file.read_text()))


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("print('<html>hello</html>')\n", r"printed no report: '<html>hello</html>'"),
        ("import sys\nsys.exit(0)\n", "printed no report"),
        ("import sys\nprint('[1, 2]')\nsys.exit(0)\n", "printed no report"),
        (
            "import json, sys\nprint(json.dumps({'v': 1, 'error': 'no_nvml', 'message': "
            "'NVML is not usable on this node: nvmlInit: LIBRARY_NOT_FOUND'}))\nsys.exit(3)\n",
            "nvmlInit: LIBRARY_NOT_FOUND; set",
        ),
        ("import sys\nprint('{}')\nsys.exit(2)\n", "the NVML child exited with 2"),
        ("import sys\nprint('{\"gpus\": 1}')\n", "unexpected report"),
    ],
    ids=["garbage", "silent", "not-an-object", "error-report", "exit-code", "bad-shape"],
)
async def test_child_misbehaviour(tmp_path: Path, body: str, match: str) -> None:
    """Garbage, silence, error reports and bad shapes are DiscoveryErrors."""
    with pytest.raises(DiscoveryError, match=match):
        await discover(10, child_cmd=_child(tmp_path, body))


async def test_missing_child_program(tmp_path: Path) -> None:
    """A child command that cannot start is a DiscoveryError, not an OSError."""
    with pytest.raises(DiscoveryError, match="cannot start the NVML child"):
        await collect_fabric(5, child_cmd=[str(tmp_path / "nope")])


async def test_valid_fake_child(tmp_path: Path) -> None:
    """A well-behaved child's report gives the GPUs and their clique."""
    body = f"print({_report([gpu(0), gpu(1)])!r})\n"
    found = await discover(10, child_cmd=_child(tmp_path, body))
    assert found.clique == "01234567-89ab-cdef-0123-456789abcdef.7"
    assert [g.index for g in found.gpus] == [0, 1]
    assert found.report.driver_version == "570.172.08"
    assert found.to_json()["clique"] == found.clique


def test_child_command_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """$IMEXD_FABRIC_CHILD_CMD replaces the child's argv; unset, it is this module."""
    monkeypatch.setenv(CHILD_CMD_ENV, "/opt/wrap --flag 'a b'")
    assert child_command() == ["/opt/wrap", "--flag", "a b"]
    monkeypatch.delenv(CHILD_CMD_ENV)
    assert child_command() == [sys.executable, "-P", "-m", "imexd.fabric", "--child"]


def test_real_nvml_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real child on this machine: a valid result, or (no NVML here) a clear error."""
    monkeypatch.delenv(CHILD_CMD_ENV, raising=False)
    if HAS_NVML:
        outcome: Discovery | DiscoveryError
        try:
            outcome = asyncio.run(discover(30))
        except DiscoveryError as exc:
            outcome = exc
        if isinstance(outcome, DiscoveryError):
            assert "IMEXD_NODE_CLIQUE" in str(outcome) or "GPU" in str(outcome)
        else:
            assert outcome.clique == "" or "." in outcome.clique
        return
    with pytest.raises(DiscoveryError) as info:
        asyncio.run(discover(30))
    message = str(info.value)
    assert "NVML" in message
    assert "LIBRARY_NOT_FOUND" in message
    assert "[node] clique (IMEXD_NODE_CLIQUE)" in message


@pytest.mark.skipif(HAS_NVML, reason="checks the no-NVML report; this machine has NVML")
def test_real_child_reports_missing_library() -> None:
    """`python -m imexd.fabric --child` without NVML prints a no_nvml report and exits 3."""
    proc = subprocess.run(
        [sys.executable, "-m", "imexd.fabric", "--child"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 3
    assert json.loads(proc.stdout)["error"] == "no_nvml"


# `imexd discover`.


def _imexd_discover(child_body: str | None, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != CHILD_CMD_ENV}
    if child_body is not None:
        env[CHILD_CMD_ENV] = shlex.join(_child(tmp_path, child_body))
    return subprocess.run(
        [IMEXD, "discover", "--timeout", "20"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(HAS_NVML, reason="checks the no-NVML failure; this machine has NVML")
def test_cli_without_nvml(tmp_path: Path) -> None:
    """`imexd discover` here exits 1 with one clear line naming the setting."""
    proc = _imexd_discover(None, tmp_path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("imexd discover: NVML is not usable on this node")
    assert "IMEXD_NODE_CLIQUE" in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_cli_with_fake_child(tmp_path: Path) -> None:
    """With a working child `imexd discover` prints the documented JSON and exits 0."""
    proc = _imexd_discover(
        (FIXTURES / "h200_child.json").read_text().join(["print('''", "''')"]), tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc == json.loads((FIXTURES / "h200_discover.json").read_text())
    assert set(doc) == {"driver_version", "nvml_version", "fabric_api", "gpus", "clique", "reason"}
    assert set(doc["gpus"][0]["fabric"]) == {
        "state",
        "status",
        "cluster_uuid",
        "clique_id",
        "health_mask",
        "error",
    }
    uuid.UUID(doc["gpus"][0]["fabric"]["cluster_uuid"])


def test_cli_rule_failure_still_shows_the_gpus(tmp_path: Path) -> None:
    """When the GPUs disagree, the JSON (clique null) and the reason are both printed, exit 1."""
    body = f"print({_report([gpu(0), gpu(1, clique=8)])!r})\n"
    proc = _imexd_discover(body, tmp_path)
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["clique"] is None
    assert "disagree" in doc["reason"]
    assert len(doc["gpus"]) == 2
    assert proc.stderr.startswith("imexd discover: GPUs disagree")


def test_cli_child_crash(tmp_path: Path) -> None:
    """A crashing child makes `imexd discover` exit 1 with the signal named, not crash."""
    proc = _imexd_discover(SEGFAULT, tmp_path)
    assert proc.returncode == 1
    assert "SIGSEGV" in proc.stderr


def test_cli_refuses_a_non_positive_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    """`--timeout 0` is a usage error (exit 2), not a discovery that can never finish."""
    with pytest.raises(SystemExit) as exited:
        main(["discover", "--timeout", "0"])
    assert exited.value.code == 2
    assert "argument --timeout: '0': expected seconds > 0" in capsys.readouterr().err


# The health child: the versioned call, isolated so a crash never costs the clique.


async def test_health_child_masks_are_merged(tmp_path: Path) -> None:
    """Masks from the health child fill the GPUs whose plain call had none."""
    body = 'import json\nprint(json.dumps({"v": 1, "health": {"0": 5, "1": None}}))\n'
    health = await collect_health(10, child_cmd=_child(tmp_path, body))
    assert health == {0: 5}
    report = report_from_json(json.loads((FIXTURES / "h200_child.json").read_text()))
    merged = with_health(report, health)
    assert merged.gpus[0].health_mask == 5
    assert with_health(report, {}) is report


@pytest.mark.parametrize(
    "body",
    [
        "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n",
        "print('not json')\n",
        'import sys\nprint(\'{"v": 1, "health": [1]}\')\nsys.exit(0)\n',
        "import sys\nsys.exit(3)\n",
    ],
)
async def test_health_child_failure_loses_only_health(tmp_path: Path, body: str) -> None:
    """A health child that crashes or prints garbage yields no masks, never an error."""
    assert await collect_health(10, child_cmd=_child(tmp_path, body)) == {}


async def test_health_child_timeout_yields_nothing(tmp_path: Path) -> None:
    """A hung health child is killed at its deadline and yields no masks."""
    body = "import time\ntime.sleep(60)\n"
    assert await collect_health(0.5, child_cmd=_child(tmp_path, body)) == {}
