"""GPU fabric discovery: which NVLink clique this node belongs to (`[node] clique = "auto"`).

The clique id is `<clusterUuid>.<cliqueId>` from NVML's GPU fabric info, and every GPU
of the node must agree (IMEX.md). NVML runs only in a child process with a timeout: on
a real H200 one pynvml fabric call killed its process with SIGSEGV, and a wedged driver
can hang a call for ever. The parent sees a crash, a hang or garbage as a
DiscoveryError naming the setting that replaces discovery, and lives on.

The child is `python -P -m imexd.fabric --child`; it imports pynvml (nowhere else in
imexd does), asks the plain `nvmlDeviceGetGpuFabricInfo` first (the versioned `...V`
call is only tried when the plain one is absent) and prints one JSON document. The
clique rule itself, `clique_from_fabric`, is a pure function of the per-GPU records.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shlex
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

from imexd.errors import DiscoveryError
from imexd.process import python_module, run_bounded

CHILD_CMD_ENV = "IMEXD_FABRIC_CHILD_CMD"
"""Replaces the NVML child's command line (shell words). For tests and for operators
who must run discovery through a wrapper; unset in normal operation."""

SET_CLIQUE_HINT = (
    "set [node] clique (IMEXD_NODE_CLIQUE) to this node's clique id, \"<cluster-uuid>."
    '<clique-id>", or to "" for a node without multi-node NVLink, instead of "auto"'
)

PLAIN_API = "nvmlDeviceGetGpuFabricInfo"
VERSIONED_API = "nvmlDeviceGetGpuFabricInfoV"


class FabricState(IntEnum):
    """nvmlGpuFabricState_t."""

    NOT_SUPPORTED = 0
    NOT_STARTED = 1
    IN_PROGRESS = 2
    COMPLETED = 3


NVML_RETURN_NAMES: dict[int, str] = {
    0: "SUCCESS",
    1: "UNINITIALIZED",
    2: "INVALID_ARGUMENT",
    3: "NOT_SUPPORTED",
    4: "NO_PERMISSION",
    5: "ALREADY_INITIALIZED",
    6: "NOT_FOUND",
    7: "INSUFFICIENT_SIZE",
    8: "INSUFFICIENT_POWER",
    9: "DRIVER_NOT_LOADED",
    10: "TIMEOUT",
    11: "IRQ_ISSUE",
    12: "LIBRARY_NOT_FOUND",
    13: "FUNCTION_NOT_FOUND",
    14: "CORRUPTED_INFOROM",
    15: "GPU_IS_LOST",
    16: "RESET_REQUIRED",
    17: "OPERATING_SYSTEM",
    18: "LIB_RM_VERSION_MISMATCH",
    19: "IN_USE",
    20: "MEMORY",
    21: "NO_DATA",
    22: "VGPU_ECC_NOT_SUPPORTED",
    23: "INSUFFICIENT_RESOURCES",
    24: "FREQ_NOT_SUPPORTED",
    25: "ARGUMENT_VERSION_MISMATCH",
    26: "DEPRECATED",
    27: "NOT_READY",
    28: "GPU_NOT_FOUND",
    29: "INVALID_STATE",
    30: "RESET_TYPE_NOT_SUPPORTED",
    999: "UNKNOWN",
}
"""nvmlReturn_t names (a stable C enum), to print the fabric `status` readably."""


def nvml_return_name(code: int) -> str:
    return NVML_RETURN_NAMES.get(code, f"NVML error {code}")


def fabric_state_name(state: int | None) -> str | None:
    if state is None:
        return None
    try:
        return FabricState(state).name
    except ValueError:
        return f"UNKNOWN({state})"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuFabric:
    """One GPU's fabric info as NVML reported it.

    `error` is the NVML error name when the fabric call itself failed (e.g.
    "NOT_SUPPORTED"); the other fabric fields are then meaningless and `state` is None.
    `health_mask` is None when only the plain (unversioned) call was used: it has none.
    """

    index: int
    uuid: str
    name: str
    state: int | None
    status: int = 0
    cluster_uuid: bytes = bytes(16)
    clique_id: int = 0
    health_mask: int | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid})" if self.uuid else f"GPU {self.index}"

    def to_json(self) -> dict[str, Any]:
        """The `imexd discover` shape of this GPU."""
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "fabric": {
                "state": fabric_state_name(self.state),
                "status": self.status,
                "cluster_uuid": str(uuid.UUID(bytes=self.cluster_uuid)),
                "clique_id": self.clique_id,
                "health_mask": self.health_mask,
                "error": self.error,
            },
        }


@dataclass(frozen=True, slots=True)
class CliqueResult:
    """The node's clique id ("" = no multi-node NVLink) and why."""

    clique: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FabricReport:
    """What the NVML child found, before the clique rule is applied."""

    driver_version: str
    nvml_version: str
    fabric_api: str
    gpus: tuple[GpuFabric, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "driver_version": self.driver_version,
            "nvml_version": self.nvml_version,
            "fabric_api": self.fabric_api,
            "gpus": [g.to_json() for g in self.gpus],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Discovery:
    """A successful discovery: the report and the clique it yields."""

    report: FabricReport
    clique: str
    reason: str

    @property
    def gpus(self) -> tuple[GpuFabric, ...]:
        return self.report.gpus

    def to_json(self) -> dict[str, Any]:
        """The document `imexd discover` prints."""
        return {**self.report.to_json(), "clique": self.clique, "reason": self.reason}


# The clique rule (pure).


def _verdict(gpu: GpuFabric) -> tuple[str, str]:
    """("clique", id) | ("none", why there is no multi-node NVLink) | ("error", why)."""
    if gpu.error == "NOT_SUPPORTED":
        return "none", "fabric info NOT_SUPPORTED by NVML"
    if gpu.error is not None:
        return "error", f"the fabric query failed with {gpu.error}"
    if gpu.state == FabricState.NOT_SUPPORTED:
        return "none", "fabric state NOT_SUPPORTED"
    if gpu.state in (FabricState.NOT_STARTED, FabricState.IN_PROGRESS):
        name = fabric_state_name(gpu.state)
        return "error", f"fabric registration {name} (the fabric manager has not finished)"
    if gpu.state != FabricState.COMPLETED:
        return "error", f"fabric state {fabric_state_name(gpu.state)}"
    if gpu.status != 0:
        return "error", f"fabric COMPLETED with status {nvml_return_name(gpu.status)}"
    if not any(gpu.cluster_uuid):
        return "none", "cluster UUID is all zero (single-node NVLink at most)"
    return "clique", f"{uuid.UUID(bytes=gpu.cluster_uuid)}.{gpu.clique_id}"


def _group(items: Sequence[tuple[GpuFabric, str]]) -> str:
    """'GPU 0 (..), GPU 1 (..): why; GPU 2 (..): other' with GPUs sharing a why joined."""
    groups: dict[str, list[str]] = {}
    for gpu, why in items:
        groups.setdefault(why, []).append(gpu.label)
    return "; ".join(f"{', '.join(labels)}: {why}" for why, labels in groups.items())


def clique_from_fabric(gpus: Sequence[GpuFabric]) -> CliqueResult:
    """Apply IMEX.md's rule to the node's GPUs.

    - every GPU COMPLETED with SUCCESS, a non-zero cluster UUID and the same
      (UUID, cliqueId): that clique, `<uuid>.<cliqueId>` (UUID 8-4-4-4-12, lowercase);
    - every GPU without multi-node NVLink (fabric NOT_SUPPORTED as a state or an NVML
      error, or an all-zero cluster UUID as on an H100 HGX): "" ;
    - no GPUs at all: "" too (a node without GPUs has no NVLink);
    - anything else raises DiscoveryError naming the GPUs: a fabric NOT_STARTED or
      IN_PROGRESS (retry later), COMPLETED with a non-success status, an NVML error, or
      GPUs that disagree (different cliques, or some with a clique and some without).
    """
    if not gpus:
        return CliqueResult("", "no GPUs: a node without GPUs has no multi-node NVLink")
    verdicts = [(gpu, *_verdict(gpu)) for gpu in gpus]
    errors = [(gpu, why) for gpu, kind, why in verdicts if kind == "error"]
    if errors:
        raise DiscoveryError(f"GPU fabric not usable: {_group(errors)}")
    cliques = {value for _, kind, value in verdicts if kind == "clique"}
    if not cliques:
        why = _group([(gpu, value) for gpu, _, value in verdicts])
        return CliqueResult("", f"no multi-node NVLink: {why}")
    if len(cliques) == 1 and all(kind == "clique" for _, kind, _ in verdicts):
        clique = next(iter(cliques))
        return CliqueResult(clique, f"all {len(gpus)} GPUs in clique {clique}")
    described = [
        (gpu, f"clique {value}" if kind == "clique" else f"no multi-node NVLink ({value})")
        for gpu, kind, value in verdicts
    ]
    raise DiscoveryError(f"GPUs disagree on the NVLink clique: {_group(described)}")


# The parent: run the child, translate every failure into a DiscoveryError.


def child_command() -> list[str]:
    """The NVML child's argv: $IMEXD_FABRIC_CHILD_CMD if set, else this module."""
    override = os.environ.get(CHILD_CMD_ENV, "").strip()
    if override:
        return shlex.split(override)
    return python_module("imexd.fabric", "--child")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _ShapeError(Exception):
    """The child's JSON has the wrong shape (internal; becomes a DiscoveryError)."""


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict):
        raise _ShapeError(f"{where} is not an object")
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _ShapeError(f"{where}.{key} is {type(value).__name__}")
    return value


def _opt_int(obj: dict[str, Any], key: str, where: str) -> int | None:
    return None if obj.get(key) is None else int(_get(obj, key, int, where))


def _gpu_from_json(doc: Any, where: str) -> tuple[GpuFabric, str]:
    fabric = _get(doc, "fabric", dict, where)
    api = doc.get("fabric_api") or ""
    error = fabric.get("error")
    if error is not None:
        if not isinstance(error, str):
            raise _ShapeError(f"{where}.fabric.error is {type(error).__name__}")
        return GpuFabric(
            index=_get(doc, "index", int, where),
            uuid=_get(doc, "uuid", str, where),
            name=_get(doc, "name", str, where),
            state=None,
            error=error,
        ), str(api)
    cluster_hex = _get(fabric, "cluster_uuid", str, f"{where}.fabric")
    try:
        cluster = bytes.fromhex(cluster_hex)
    except ValueError:
        raise _ShapeError(f"{where}.fabric.cluster_uuid is not hex") from None
    if len(cluster) != 16:
        raise _ShapeError(f"{where}.fabric.cluster_uuid has {len(cluster)} bytes, not 16")
    return GpuFabric(
        index=_get(doc, "index", int, where),
        uuid=_get(doc, "uuid", str, where),
        name=_get(doc, "name", str, where),
        state=_get(fabric, "state", int, f"{where}.fabric"),
        status=_get(fabric, "status", int, f"{where}.fabric"),
        cluster_uuid=cluster,
        clique_id=_get(fabric, "clique_id", int, f"{where}.fabric"),
        health_mask=_opt_int(fabric, "health_mask", f"{where}.fabric"),
    ), str(api)


def report_from_json(doc: Any) -> FabricReport:
    """The child's success document -> FabricReport; DiscoveryError on a wrong shape."""
    try:
        raw_gpus = _get(doc, "gpus", list, "report")
        parsed = [_gpu_from_json(g, f"gpus[{i}]") for i, g in enumerate(raw_gpus)]
        apis = sorted({api for _, api in parsed if api})
        return FabricReport(
            driver_version=_get(doc, "driver_version", str, "report"),
            nvml_version=_get(doc, "nvml_version", str, "report"),
            fabric_api=",".join(apis),
            gpus=tuple(gpu for gpu, _ in parsed),
        )
    except _ShapeError as exc:
        raise DiscoveryError(f"the NVML child printed an unexpected report: {exc}") from None


async def collect_fabric(
    timeout: float,  # noqa: ASYNC109 - the child's kill deadline, not the caller's
    *,
    child_cmd: Sequence[str] | None = None,
) -> FabricReport:
    """Run the NVML child once and return what it found, or raise DiscoveryError."""
    argv = list(child_cmd) if child_cmd is not None else child_command()
    try:
        result = await run_bounded(argv, timeout=timeout)
    except TimeoutError:
        raise DiscoveryError(
            f"the NVML child timed out after {timeout:g} s and was killed (a hung driver?); "
            + SET_CLIQUE_HINT
        ) from None
    except OSError as exc:
        raise DiscoveryError(
            f"cannot start the NVML child {shlex.join(argv)}: {exc}; " + SET_CLIQUE_HINT
        ) from exc
    if result.rc < 0:
        tail = result.tail()
        raise DiscoveryError(
            f"the NVML child died with {_signal_name(-result.rc)} (an NVML call crashed it; "
            f"the agent is unaffected){': ' + tail if tail else ''}; " + SET_CLIQUE_HINT
        )
    try:
        doc = json.loads(result.stdout)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        shown = (result.stdout.strip() or result.tail() or "nothing")[:200]
        raise DiscoveryError(
            f"the NVML child exited with {result.rc} and printed no report: {shown!r}; "
            + SET_CLIQUE_HINT
        )
    if "error" in doc or result.rc != 0:
        message = doc.get("message") if isinstance(doc.get("message"), str) else None
        raise DiscoveryError(
            f"{message or f'the NVML child exited with {result.rc}'}; " + SET_CLIQUE_HINT
        )
    return report_from_json(doc)


async def discover(
    timeout: float,  # noqa: ASYNC109 - the child's kill deadline, not the caller's
    *,
    child_cmd: Sequence[str] | None = None,
) -> Discovery:
    """Collect the fabric info in a child and apply the clique rule; DiscoveryError on
    any failure (the agent keeps running and tries again, backing off)."""
    report = await collect_fabric(timeout, child_cmd=child_cmd)
    if child_cmd is None and not os.environ.get(CHILD_CMD_ENV, "").strip():
        report = with_health(report, await collect_health(timeout))
    result = clique_from_fabric(report.gpus)
    return Discovery(report=report, clique=result.clique, reason=result.reason)


def discover_report(timeout: float) -> tuple[dict[str, Any], str | None]:
    """What `imexd discover` prints: the report and its clique as JSON, and why the clique
    rule failed (None when it did not; the JSON then has `"clique": null`). DiscoveryError
    when the GPUs could not be read at all. Blocking: for the CLI, not inside a loop."""
    report = asyncio.run(collect_fabric(timeout))
    try:
        result = clique_from_fabric(report.gpus)
    except DiscoveryError as exc:
        return {**report.to_json(), "clique": None, "reason": str(exc)}, str(exc)
    discovery = Discovery(report=report, clique=result.clique, reason=result.reason)
    return discovery.to_json(), None


# The child: the only code in imexd that touches pynvml.


class _ChildError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


_NO_NVML = frozenset({"LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED", "NO_PERMISSION"})


def _nvml_error_name(exc: BaseException) -> str:
    value = getattr(exc, "value", None)
    return nvml_return_name(value) if isinstance(value, int) else type(exc).__name__


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class _FabricInfo(ctypes.Structure):
    """nvmlGpuFabricInfo_t exactly as nvml.h declares it.

    pynvml's own structure is not used: nvidia-ml-py 13.610.43 declares its
    clusterUuid 80 bytes long instead of 16, which shifts status, cliqueId and state
    to offsets NVML never writes, so every GPU would read as NOT_SUPPORTED.
    """

    _fields_ = (
        ("clusterUuid", ctypes.c_ubyte * 16),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
    )


class _FabricInfoV2(ctypes.Structure):
    """nvmlGpuFabricInfo_v2_t (nvmlGpuFabricInfoV_t) as nvml.h declares it."""

    _fields_ = (
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_ubyte * 16),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
        ("healthMask", ctypes.c_uint),
    )


_FABRIC_INFO_V2_VERSION = ctypes.sizeof(_FabricInfoV2) | (2 << 24)
"""NVML_STRUCT_VERSION(GpuFabricInfo, 2) = 0x02000024."""


def _fabric_fields(info: _FabricInfo | _FabricInfoV2) -> dict[str, Any]:
    return {
        "state": int(info.state),
        "status": int(info.status),
        "cluster_uuid": bytes(info.clusterUuid).hex(),
        "clique_id": int(info.cliqueId),
        "health_mask": int(info.healthMask) if isinstance(info, _FabricInfoV2) else None,
        "error": None,
    }


def _child_fabric(pynvml: Any, handle: Any) -> tuple[dict[str, Any], str]:
    """One GPU's fabric info: the plain call first, the versioned one only if absent.

    The structure is passed by reference: pynvml's wrappers hand their argument to C
    as is, and a structure passed by value is what crashed the versioned call on a
    real H200 (SIGSEGV); by reference both calls work there.
    """
    plain = getattr(pynvml, PLAIN_API, None)
    if plain is not None:
        info = _FabricInfo()
        try:
            plain(handle, ctypes.byref(info))
        except pynvml.NVMLError as exc:
            if _nvml_error_name(exc) != "FUNCTION_NOT_FOUND":
                return {"error": _nvml_error_name(exc)}, PLAIN_API
        else:
            return _fabric_fields(info), PLAIN_API
    versioned = getattr(pynvml, VERSIONED_API, None)
    if versioned is None:
        return {"error": "FUNCTION_NOT_FOUND"}, ""
    vinfo = _FabricInfoV2(version=_FABRIC_INFO_V2_VERSION)
    try:
        versioned(handle, ctypes.byref(vinfo))
    except pynvml.NVMLError as exc:
        return {"error": _nvml_error_name(exc)}, VERSIONED_API
    return _fabric_fields(vinfo), VERSIONED_API


def _child_report() -> dict[str, Any]:
    try:
        import pynvml  # noqa: PLC0415 - confined to the child on purpose
    except ImportError as exc:
        raise _ChildError(
            "no_nvml", f"the NVML Python binding (nvidia-ml-py) cannot be imported: {exc}"
        ) from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        name = _nvml_error_name(exc)
        kind = "no_nvml" if name in _NO_NVML else "nvml_error"
        message = f"NVML is not usable on this node: nvmlInit: {name} ({exc})"
        raise _ChildError(kind, message) from exc
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        nvml_version = _text(pynvml.nvmlSystemGetNVMLVersion())
        gpus = []
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            fabric, api = _child_fabric(pynvml, handle)
            gpus.append(
                {
                    "index": index,
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "fabric_api": api,
                    "fabric": fabric,
                }
            )
    except pynvml.NVMLError as exc:
        name = _nvml_error_name(exc)
        raise _ChildError("nvml_error", f"NVML query failed: {name} ({exc})") from exc
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return {"v": 1, "driver_version": driver, "nvml_version": nvml_version, "gpus": gpus}


def child_main() -> int:
    """Entry point of the NVML child: one JSON document on stdout; exit 0, or 3 with
    `{"error": kind, "message": ...}` (kind `no_nvml`, `nvml_error` or `child_error`)."""
    try:
        doc = _child_report()
        code = 0
    except _ChildError as exc:
        doc, code = {"v": 1, "error": exc.kind, "message": exc.message}, 3
    except Exception as exc:  # the child reports, the parent decides
        doc, code = {"v": 1, "error": "child_error", "message": f"{type(exc).__name__}: {exc}"}, 3
    print(json.dumps(doc), flush=True)
    return code


def _child_health() -> dict[str, Any]:
    """Per GPU index, the health mask from the versioned fabric call (None if absent)."""
    import pynvml  # noqa: PLC0415 - confined to the child on purpose

    pynvml.nvmlInit()
    try:
        versioned = getattr(pynvml, VERSIONED_API, None)
        health: dict[str, int | None] = {}
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            mask: int | None = None
            if versioned is not None:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                info = _FabricInfoV2(version=_FABRIC_INFO_V2_VERSION)
                with contextlib.suppress(pynvml.NVMLError):
                    versioned(handle, ctypes.byref(info))
                    mask = int(info.healthMask)
            health[str(index)] = mask
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return {"v": 1, "health": health}


def child_health_main() -> int:
    """Entry point of the health child: `{"v": 1, "health": {index: mask}}`, or exit 3.

    A separate process from the main child: the versioned call is the one that has
    crashed a process on a real H200, so it must never cost the clique result.
    """
    try:
        doc, code = _child_health(), 0
    except Exception as exc:  # the child reports, the parent decides
        doc, code = {"v": 1, "error": "child_error", "message": f"{type(exc).__name__}: {exc}"}, 3
    print(json.dumps(doc), flush=True)
    return code


async def collect_health(
    timeout: float,  # noqa: ASYNC109 - the child's kill deadline
    *,
    child_cmd: Sequence[str] | None = None,
) -> dict[int, int]:
    """Health masks by GPU index from the health child; {} when it fails in any way.

    Health is informative (`imexd discover` shows it); the clique never depends on it.
    """
    argv = list(child_cmd) if child_cmd is not None else [*child_command(), "--health"]
    try:
        result = await run_bounded(argv, timeout=timeout)
        doc = json.loads(result.stdout) if result.rc == 0 else None
    except (TimeoutError, OSError, ValueError):
        return {}
    health = doc.get("health") if isinstance(doc, dict) else None
    if not isinstance(health, dict):
        return {}
    return {
        int(k): v
        for k, v in health.items()
        if isinstance(k, str) and k.isdigit() and isinstance(v, int) and not isinstance(v, bool)
    }


def with_health(report: FabricReport, health: Mapping[int, int]) -> FabricReport:
    """The report with health masks filled in where the plain call left them unknown."""
    if not health:
        return report
    gpus = tuple(
        replace(g, health_mask=health[g.index])
        if g.health_mask is None and g.index in health
        else g
        for g in report.gpus
    )
    return replace(report, gpus=gpus)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        sys.exit(child_main())
    if sys.argv[1:] == ["--child", "--health"]:
        sys.exit(child_health_main())
    # The discover command itself is `imexd discover` (cli.py): importing the CLI here
    # would close an import cycle (cli -> agent -> fabric -> cli).
    sys.exit("usage: python -m imexd.fabric --child [--health]; run `imexd discover` instead")
