"""IMEX channel devices for workloads: what the driver offers, what to make, and making it.

A workload (`WorkloadRecord`) owns one IMEX channel of its domain. On each node it lists,
the agent makes the character device `<dev_dir>/channel<N>` (major: the
`nvidia-caps-imex-channels` line of /proc/devices, minor N) with the workload's owner and
mode, plus a CDI spec (`<cdi_dir>/imexd-<workload>.json`, for podman, containerd and
CRI-O) and an env file (`<env_dir>/<workload>.env`, for bare metal and Slurm).

Three layers, so the rules are testable without root:

- `read_driver` reads the kernel's device list and the driver's parameters; it never
  raises (a missing file is a fact to report, not a crash).
- `plan` is pure: the node's wanted devices from the workload records, and a `Refusal`
  with its reason for every listed workload that gets none. A channel is one workload's
  across the domain (`channel_holders` says whose): two records on it conflict on every
  node, whatever their node lists.
- `Devices` is the filesystem side. `apply` makes dev_dir exactly the wanted set: every
  other `channel<digits>` node goes (the CVE-2024-42511 cleanup: a stale or driver-made
  world-writable channel would let any local process join another workload's IMEX
  channel). It blocks (mknod, fsync): the agent runs it in a worker thread.

Nothing here follows a symlink when removing or fixing: entries are looked at with
lstat, and a symlink named like one of our files is replaced, its target untouched.

A simulated driver (`[channels] simulate`, a machine without a GPU) changes one thing:
where mknod is not permitted (EPERM: an unprivileged agent has no CAP_MKNOD), the node
is a stand-in, a regular file whose text says it is none (`standin_text`), given the
same owner and mode. Nothing can reach IMEX through it; the channel is reported ready
with the reason Simulated. Without the setting a regular file is never taken for a
channel.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

import msgspec

from imexd.errors import FileWriteError
from imexd.files import TEMP_SUFFIX, write_atomic
from imexd.messages import MAX_CHANNEL, WorkloadRecord
from imexd.settings import ChannelsSettings

DEVICE_NAME: Final = "nvidia-caps-imex-channels"
"""The character device's name on its /proc/devices line."""
CONTAINER_DEV_DIR: Final = "/dev/nvidia-caps-imex-channels"
"""Where the channel appears inside a container (the path the CUDA driver opens)."""
CDI_KIND: Final = "imexd.io/channel"
"""The CDI kind: a container asks for `imexd.io/channel=<workload>`."""
CDI_VERSION: Final = "0.6.0"
CDI_PREFIX: Final = "imexd-"
CDI_SUFFIX: Final = ".json"
ENV_SUFFIX: Final = ".env"
DEV_DIR_MODE: Final = 0o755
HANDOFF_MODE: Final = 0o644
"""CDI specs and env files hold no secret; the container runtime and job scripts read them."""
MAX_ID: Final = 4294967294
"""The largest uid or gid (4294967295 is chown's "leave as is")."""
MAX_MAJOR: Final = (1 << 12) - 1
"""The largest major number Linux has."""

NO_CHANNEL_DEVICE: Final = "NoChannelDevice"
CHANNEL_OUT_OF_RANGE: Final = "ChannelOutOfRange"
CHANNEL_CONFLICT: Final = "ChannelConflict"
MKNOD_FAILED: Final = "MknodFailed"
CDI_WRITE_FAILED: Final = "CdiWriteFailed"
ENV_WRITE_FAILED: Final = "EnvWriteFailed"
SIMULATED: Final = "Simulated"
"""The reason a ready channel of a simulated driver carries ([channels] simulate)."""
STANDIN_HEADER: Final = "imexd stand-in for an IMEX channel device: NOT a device node"
"""The first line of a stand-in file: what anyone who opens it reads first."""
_STANDIN_LIMIT: Final = 4096

_CHANNEL_NAME: Final = re.compile(r"channel([0-9]+)", re.ASCII)
_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", re.ASCII)
_CLIQUE: Final = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})?", re.ASCII)
_READ_LIMIT: Final = 1 << 20
"""/proc/devices and the driver's params are a few KiB; a larger file is not one of them."""
_PARAM: Final = re.compile(r"\s*([A-Za-z0-9_]+)\s*:\s*(\S*)\s*")


# --- what the driver offers -----------------------------------------------------------


class Driver(msgspec.Struct, frozen=True):
    """What the kernel and the NVIDIA driver offer for IMEX channels."""

    major: int | None
    """The channel devices' major; None: /proc/devices has no nvidia-caps-imex-channels line."""
    count: int | None
    """ImexChannelCount: channels 0..count-1 exist; None: unreadable."""
    channel0: bool | None
    """CreateImexChannel0: True when the driver made a world-writable channel0."""
    error: str = ""
    """Why something is unknown, one clause per fact; "" when all three were read."""
    major_error: str = ""
    """Why `major` is unknown, alone: the reason a workload gets no device (NoChannelDevice)."""


def parse_proc_devices(text: str) -> int | None:
    """The major of the `nvidia-caps-imex-channels` character device, or None.

    Only the "Character devices:" block counts: a block device of the same name is not
    the channel device. A line whose number is not a major Linux can have is ignored.
    """
    in_chars = False
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith(":"):
            in_chars = line == "Character devices:"
            continue
        if not in_chars:
            continue
        number, _, name = line.partition(" ")
        major = _whole(number)
        if name.strip() == DEVICE_NAME and major is not None and 0 < major <= MAX_MAJOR:
            return major
    return None


def parse_driver_params(text: str) -> tuple[int | None, bool | None]:
    """`(ImexChannelCount, CreateImexChannel0)` from /proc/driver/nvidia/params.

    Lines are `Key: value`; a missing key or a value that is not a whole number gives
    None for that fact. A count of 0 is kept (the driver then offers no channel); a
    negative one is not a count.
    """
    values: dict[str, str] = {}
    for line in text.splitlines():
        match = _PARAM.fullmatch(line)
        if match is not None:
            values.setdefault(match.group(1), match.group(2))
    count = _whole(values.get("ImexChannelCount"))
    if count is not None and count > MAX_CHANNEL + 1:
        count = None
    channel0 = _whole(values.get("CreateImexChannel0"))
    return count, None if channel0 is None else channel0 != 0


def _whole(value: str | None) -> int | None:
    """A whole number of at most ten digits (longer is no driver's value), else None."""
    if value is None or not value.isascii() or not value.isdigit() or len(value) > 10:
        return None
    return int(value)


def _read(path: str) -> tuple[str | None, str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read(_READ_LIMIT), ""
    except OSError as exc:
        return None, f"cannot read {path}: {_reason(exc)}"


def read_driver(settings: ChannelsSettings) -> Driver:
    """Read the major from proc_devices and the count from driver_params; never raises."""
    problems: list[str] = []
    devices, problem = _read(settings.proc_devices)
    major: int | None = None
    if devices is not None:
        major = parse_proc_devices(devices)
        if major is None:
            problem = (
                f"{settings.proc_devices} lists no {DEVICE_NAME} character device "
                "(the NVIDIA driver is not loaded, or too old for IMEX channels)"
            )
    if major is None:
        problems.append(problem)
    params, problem = _read(settings.driver_params)
    count: int | None = None
    channel0: bool | None = None
    if params is None:
        problems.append(problem)
    else:
        count, channel0 = parse_driver_params(params)
        if count is None:
            problems.append(f"{settings.driver_params} has no ImexChannelCount")
        if channel0 is None:
            problems.append(f"{settings.driver_params} has no CreateImexChannel0")
    return Driver(
        major=major,
        count=count,
        channel0=channel0,
        error="; ".join(problems),
        major_error="" if major is not None else problems[0],
    )


# --- what the node should have ---------------------------------------------------------


class Want(msgspec.Struct, frozen=True):
    """One channel device this node should have, and who it is for."""

    workload: str
    domain: str
    clique: str
    channel: int
    uid: int
    gid: int
    mode: int
    """Permission bits of the device node (and the CDI spec's fileMode)."""
    generation: int


class Refusal(msgspec.Struct, frozen=True):
    """A listed workload that gets no device on this node, and why."""

    workload: str
    channel: int
    generation: int
    reason: str
    """One of NoChannelDevice, ChannelOutOfRange, ChannelConflict, MknodFailed,
    CdiWriteFailed, EnvWriteFailed (the ChannelInfo reason in the HealthReport)."""
    message: str


def _by_channel(records: Iterable[WorkloadRecord], domain: str) -> dict[int, list[WorkloadRecord]]:
    """The active records of `domain` (each name's newest), by channel and name: a
    `claiming` record only reserves its channel in the control plane."""
    active: dict[str, WorkloadRecord] = {}
    for record in records:
        if record.state != "active" or record.domain != domain:
            continue
        seen = active.get(record.workload)
        if seen is None or record.generation > seen.generation:
            active[record.workload] = record
    by_channel: dict[int, list[WorkloadRecord]] = {}
    for name in sorted(active):
        by_channel.setdefault(active[name].channel, []).append(active[name])
    return by_channel


def channel_holders(
    records: Iterable[WorkloadRecord], *, domain: str, before: Mapping[int, str]
) -> dict[int, str]:
    """Channel -> the workload of `domain` that holds it, given who held it `before`.

    IMEX channels are domain-wide: the holder `before` keeps its channel while its record
    is active on it; a channel with one active record is that one's; one that several
    records claim with no holder among them has none, so no node picks another winner
    than a node that saw who came first. The agent passes its previous answer as `before`
    (at start `Devices.held_on_disk`): every node sees records in the broker's order.
    """
    holders: dict[int, str] = {}
    for channel, group in _by_channel(records, domain).items():
        names = [record.workload for record in group]
        holder = before.get(channel)
        if holder in names:
            holders[channel] = holder
        elif len(names) == 1:
            holders[channel] = names[0]
    return holders


def plan(
    records: Iterable[WorkloadRecord],
    *,
    node: str,
    domain: str,
    clique: str,
    driver: Driver,
    held: Mapping[int, str],
) -> tuple[dict[int, Want], list[Refusal]]:
    """The devices `node` should have, by channel, and the refusals, by workload name.

    Only active records of `domain` count, and all of them: two on one channel conflict
    on every node, whatever their node lists. `held` maps a channel to the workload that
    holds it in the domain (`channel_holders`): of several workloads on one channel, that
    one keeps it; when it is not among them, none gets the channel. Devices are wanted,
    and refusals given, only for the records that list `node`.
    """
    wants: dict[int, Want] = {}
    refusals: list[Refusal] = []
    for channel, group in _by_channel(records, domain).items():
        keeper = _keeper(group, held.get(channel))
        for record in group:
            if not record.lists(node):
                continue
            refusal = _refusal(record, group, keeper, driver)
            if refusal is not None:
                refusals.append(refusal)
                continue
            wants[channel] = Want(
                workload=record.workload,
                domain=record.domain,
                clique=clique,
                channel=channel,
                uid=record.uid,
                gid=record.gid,
                mode=record.mode,
                generation=record.generation,
            )
    refusals.sort(key=lambda refusal: refusal.workload)
    ordered = sorted(wants.values(), key=lambda want: want.workload)
    return {want.channel: want for want in ordered}, refusals


def _keeper(group: list[WorkloadRecord], holder: str | None) -> str | None:
    """Who gets a channel: the only workload on it, else the one already holding it."""
    if len(group) == 1:
        return group[0].workload
    return holder if any(record.workload == holder for record in group) else None


def _refusal(
    record: WorkloadRecord, group: list[WorkloadRecord], keeper: str | None, driver: Driver
) -> Refusal | None:
    channel = record.channel

    def refuse(reason: str, message: str) -> Refusal:
        return Refusal(
            workload=record.workload,
            channel=channel,
            generation=record.generation,
            reason=reason,
            message=message,
        )

    if driver.major is None:
        # The major's own clause alone: it must stay whole within a report's message.
        why = driver.major_error or driver.error or f"no {DEVICE_NAME} device is known"
        return refuse(NO_CHANNEL_DEVICE, why)
    if driver.count is not None and channel >= driver.count:
        return refuse(
            CHANNEL_OUT_OF_RANGE,
            f"channel {channel} is out of range: the driver's ImexChannelCount is "
            f"{driver.count} (channels 0..{driver.count - 1})",
        )
    if keeper == record.workload:
        return None
    others = ", ".join(other.workload for other in group if other is not record)
    if keeper is None:
        outcome = "none of them gets it until only one is left"
    else:
        outcome = f"{keeper} keeps it (it held the channel first)"
    return refuse(
        CHANNEL_CONFLICT,
        f"channel {channel} is also used by workload(s) {others} of domain "
        f"{record.domain} (a channel is one workload's across the domain); {outcome}",
    )


# --- hand-off files -------------------------------------------------------------------


def _check_want(want: Want) -> None:
    """Refuse values that could leave their folder or break a line (named in the error)."""
    if not _LABEL.fullmatch(want.workload):
        raise ValueError(f"workload name {want.workload!r} is not a DNS-1123 label")
    if not _LABEL.fullmatch(want.domain):
        raise ValueError(f"domain name {want.domain!r} is not a DNS-1123 label")
    if not _CLIQUE.fullmatch(want.clique):
        raise ValueError(f"clique {want.clique!r} is not a clique id")
    if not 0 <= want.channel <= MAX_CHANNEL:
        raise ValueError(f"channel {want.channel!r} is not in 0..{MAX_CHANNEL}")
    if not 0 <= want.mode <= 0o777:
        raise ValueError(f"mode {want.mode:#o} has bits beyond 0o777")
    for key, value in (("uid", want.uid), ("gid", want.gid)):
        if not 0 <= value <= MAX_ID:
            raise ValueError(f"{key} {value!r} is not in 0..{MAX_ID}")


def container_path(channel: int) -> str:
    """The channel's device path inside a container (and the env file's device path)."""
    return f"{CONTAINER_DEV_DIR}/channel{channel}"


def _env(want: Want) -> list[str]:
    return [
        f"IMEX_CHANNEL={want.channel}",
        f"IMEXD_WORKLOAD={want.workload}",
        f"IMEXD_DOMAIN={want.domain}",
        f"IMEXD_CLIQUE={want.clique}",
    ]


def cdi_spec(want: Want, *, major: int, dev_dir: str) -> dict[str, Any]:
    """The CDI spec that gives a container exactly this workload's channel.

    Raises ValueError for a want whose names could not be written safely.
    """
    _check_want(want)
    node = {
        "path": container_path(want.channel),
        "hostPath": os.path.join(dev_dir, f"channel{want.channel}"),
        "type": "c",
        "major": major,
        "minor": want.channel,
        "fileMode": want.mode,
        "permissions": "rw",
        "uid": want.uid,
        "gid": want.gid,
    }
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [
            {"name": want.workload, "containerEdits": {"deviceNodes": [node], "env": _env(want)}}
        ],
    }


def env_text(want: Want) -> str:
    """The env file: `KEY=value` lines for systemd's EnvironmentFile and `set -a; . file`.

    Raises ValueError for a want whose names could not be written safely.
    """
    _check_want(want)
    lines = [*_env(want), f"IMEXD_CHANNEL_DEVICE={container_path(want.channel)}"]
    return "\n".join(lines) + "\n"


def cdi_file_name(workload: str) -> str:
    return f"{CDI_PREFIX}{workload}{CDI_SUFFIX}"


def env_file_name(workload: str) -> str:
    return f"{workload}{ENV_SUFFIX}"


def standin_text(major: int, channel: int) -> str:
    """The content of the stand-in for channel `channel`'s device node (simulate)."""
    return (
        f"{STANDIN_HEADER}\n"
        f"It stands in for the character device {major}:{channel} ({DEVICE_NAME} channel "
        f"{channel}) of a simulated driver: [channels] simulate = true, and the agent may "
        "not mknod.\n"
    )


def _is_standin(path: str, text: str) -> bool:
    """Whether the regular file at `path` (not followed) holds exactly `text`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            return file.read(_STANDIN_LIMIT + 1) == text.encode()
    except OSError:
        return False


def _make_standin(path: str, text: str) -> None:
    """Create the stand-in at `path` with no permission bits (the caller sets the owner
    and then the mode, as for a node); it must not exist."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0)
    with os.fdopen(fd, "wb") as file:
        file.write(text.encode())


# --- the filesystem side ----------------------------------------------------------------


class Applied(msgspec.Struct, frozen=True):
    """What `Devices.apply` left on disk."""

    made: dict[str, Want]
    """Workload -> want: device node, CDI spec and env file in place."""
    failures: list[Refusal]
    """MknodFailed, CdiWriteFailed or EnvWriteFailed per workload, by workload name."""
    ops: Counter[tuple[str, str]]
    """(op, result) -> how many: op in mknod, fix, remove, cdi, env; result ok or error."""
    channel0_open: bool
    """<dev_dir>/channel0 exists after apply with any of the o+rw bits: anyone can open it."""
    held: dict[int, str]
    """Channel -> workload whose device node now exists (the next plan's `held`)."""
    problems: list[str] = msgspec.field(default_factory=list)
    """Stale entries that could not be removed (a security matter: say so in the logs)."""
    standins: frozenset[str] = frozenset()
    """Workloads of `made` whose node is a stand-in file (`[channels] simulate`)."""


def _refuse(want: Want, reason: str, message: str, *, channel: int | None = None) -> Refusal:
    return Refusal(
        workload=want.workload,
        channel=want.channel if channel is None else channel,
        generation=want.generation,
        reason=reason,
        message=message,
    )


def _is_cdi_name(name: str) -> bool:
    return name.startswith(CDI_PREFIX) and name.endswith(CDI_SUFFIX)


def _is_env_name(name: str) -> bool:
    """Every `*.env` in env_dir is ours (hidden names are not: a shell glob skips them)."""
    return name.endswith(ENV_SUFFIX) and not name.startswith(".")


def _reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    text = os.strerror(exc.errno) if exc.errno else str(exc)
    return f"{text} ({name})" if name else text


def _inside(folder: str, name: str) -> str:
    """`folder/name`, refusing a name that would leave the folder."""
    if not name or "/" in name or "\0" in name or name in {".", ".."}:
        raise ValueError(f"file name {name!r} would leave {folder}")
    return os.path.join(folder, name)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _entries(folder: str) -> list[str]:
    """The names in `folder`; none when it does not exist."""
    try:
        return sorted(os.listdir(folder))
    except FileNotFoundError:
        return []


class _StepError(Exception):
    """An OSError together with what was being done (for a Refusal message)."""

    def __init__(self, what: str, error: OSError) -> None:
        self.what = what
        self.error = error
        super().__init__(f"{what}: {_reason(error)}")


@contextlib.contextmanager
def _step(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise _StepError(what, exc) from exc


class Devices:
    """The channel nodes, CDI specs and env files of this node; blocking calls.

    dev_dir is owned by imexd: `apply` removes every `channel<digits>` entry no wanted
    workload owns (except channel0 with `keep_channel0` while nobody wants channel 0) and
    leaves every other name alone. In cdi_dir only `imexd-*.json` files are ours; in
    env_dir every `*.env` file is.
    """

    def __init__(self, settings: ChannelsSettings) -> None:
        self._settings = settings
        self._dev_dir = settings.dev_dir
        self._cdi_dir = settings.cdi_dir
        self._env_dir = settings.env_dir

    def apply(self, wants: Mapping[int, Want], *, major: int | None) -> Applied:
        """Make dev_dir, cdi_dir and env_dir exactly `wants` (channel -> want).

        A failure on one channel does not stop the others: it is a Refusal naming the
        path and the errno text. With `major` None nothing can be made (every want is
        refused as NoChannelDevice) but stale nodes and files are still removed.
        """
        ops: Counter[tuple[str, str]] = Counter()
        failures: list[Refusal] = []
        problems: list[str] = []
        held: dict[int, str] = {}
        made: dict[str, Want] = {}
        standins: set[str] = set()

        for channel, want in sorted(wants.items(), key=lambda item: item[1].workload):
            if major is None:
                message = f"no {DEVICE_NAME} device to make channel{channel}"
                failures.append(_refuse(want, NO_CHANNEL_DEVICE, message))
                continue
            node = self._make_node(channel, want, major, ops)
            refusal = node if isinstance(node, Refusal) else None
            if refusal is None:
                held[channel] = want.workload
                if node is True:
                    standins.add(want.workload)
                refusal = self._handoff(want, major, ops)
            if refusal is not None:
                failures.append(refusal)
                continue
            made[want.workload] = want

        keep0 = self._settings.keep_channel0 and 0 not in wants
        self._remove_stale_nodes(set(held), keep0=keep0, ops=ops, problems=problems)
        keep = set(held.values())
        self._remove_stale_files(
            self._cdi_dir,
            keep={cdi_file_name(name) for name in keep},
            ours=_is_cdi_name,
            ops=ops,
            problems=problems,
        )
        self._remove_stale_files(
            self._env_dir,
            keep={env_file_name(name) for name in keep},
            ours=_is_env_name,
            ops=ops,
            problems=problems,
        )
        failures.sort(key=lambda refusal: refusal.workload)
        return Applied(
            made=made,
            failures=failures,
            ops=ops,
            channel0_open=self._channel0_open(),
            held=held,
            problems=problems,
            standins=frozenset(standins & set(made)),
        )

    def clear(self) -> Applied:
        """Remove every channel node, CDI spec and env file of ours (a leave).

        channel0 stays with `keep_channel0`: the driver made it, not imexd.
        """
        return self.apply({}, major=None)

    def held_on_disk(self, major: int | None) -> dict[int, str]:
        """Channel -> workload, for the devices a previous agent made and still in place.

        Read from our CDI specs: one whose node in dev_dir is still the channel's device
        (type, major and minor) names the workload that holds it. The agent passes this as
        the first plan's `held`, so that a restart keeps a conflict sticky instead of
        taking the channel from the workload that had it. Never raises.
        """
        held: dict[int, str] = {}
        if major is None:
            return held
        try:
            names = _entries(self._cdi_dir)
        except OSError:
            return held
        for name in names:
            if not _is_cdi_name(name):
                continue
            workload = name[len(CDI_PREFIX) : -len(CDI_SUFFIX)]
            channel = _spec_channel(_inside(self._cdi_dir, name), workload)
            if channel is None or channel in held:
                continue
            path = os.path.join(self._dev_dir, f"channel{channel}")
            try:
                node = os.lstat(path)
            except OSError:
                continue
            if self._is_channel(path, node, major, channel):
                held[channel] = workload
        return held

    def _is_channel(self, path: str, node: os.stat_result, major: int, channel: int) -> bool:
        """Whether `node` (lstat of `path`) is channel `channel`'s device, or with
        `simulate` its stand-in."""
        if stat.S_ISCHR(node.st_mode):
            return node.st_rdev == os.makedev(major, channel)
        return (
            self._settings.simulate
            and stat.S_ISREG(node.st_mode)
            and _is_standin(path, standin_text(major, channel))
        )

    # --- device nodes ---

    def _make_node(
        self, channel: int, want: Want, major: int, ops: Counter[tuple[str, str]]
    ) -> Refusal | bool:
        """The want's node in place (True: as a stand-in file), or why not."""
        if channel != want.channel or not 0 <= channel <= MAX_CHANNEL:
            message = f"key {channel} of the wanted devices is not the want's channel"
            return _refuse(want, MKNOD_FAILED, f"{message} {want.channel}", channel=channel)
        if not 0 <= want.mode <= 0o777:
            return _refuse(want, MKNOD_FAILED, f"mode {want.mode:#o} has bits beyond 0o777")
        if not (0 <= want.uid <= MAX_ID and 0 <= want.gid <= MAX_ID):
            # chown takes -1 as "leave as is": the node would keep a previous owner.
            message = f"owner {want.uid}:{want.gid} is not in 0..{MAX_ID}"
            return _refuse(want, MKNOD_FAILED, message)
        path = os.path.join(self._dev_dir, f"channel{channel}")
        try:
            return self._ensure_node(path, major, want, ops)
        except _StepError as exc:
            return _refuse(want, MKNOD_FAILED, str(exc))

    def _ensure_node(
        self, path: str, major: int, want: Want, ops: Counter[tuple[str, str]]
    ) -> bool:
        """The want's char device (major, its channel) at `path` with its owner and mode;
        True when it is a stand-in file instead (`simulate`, and mknod not permitted).

        A correct node is fixed in place (its inode kept, so an open file stays valid);
        anything else there is unlinked (a symlink itself, never its target) and made anew.
        """
        device = os.makedev(major, want.channel)
        with _step(f"stat {path}"):
            current = _lstat(path)
        if current is not None and self._is_channel(path, current, major, want.channel):
            standin = not stat.S_ISCHR(current.st_mode)
            if (current.st_uid, current.st_gid) == (want.uid, want.gid) and stat.S_IMODE(
                current.st_mode
            ) == want.mode:
                return standin
            try:
                with _step(f"chown {path} to {want.uid}:{want.gid}"):
                    os.chown(path, want.uid, want.gid, follow_symlinks=False)
                with _step(f"chmod {path} to {want.mode:#o}"):
                    os.chmod(path, want.mode)
            except _StepError:
                ops["fix", "error"] += 1
                self._discard(path, ops)
                raise
            ops["fix", "ok"] += 1
            return standin
        if current is not None:
            try:
                with _step(f"remove {path} (not the channel's device)"):
                    os.unlink(path)
            except _StepError:
                ops["remove", "error"] += 1
                raise
            ops["remove", "ok"] += 1
        else:
            self._ensure_dev_dir()
        # Made without any permission first, so that no one can open it before the owner
        # is right; chmod after chown also sidesteps the umask.
        standin = False
        try:
            with _step(f"mknod {path}"):
                os.mknod(path, stat.S_IFCHR, device)
        except _StepError as exc:
            if not (self._settings.simulate and exc.error.errno == errno.EPERM):
                ops["mknod", "error"] += 1
                raise
            standin = True
        if standin:
            try:
                with _step(f"create the stand-in {path}"):
                    _make_standin(path, standin_text(major, want.channel))
            except _StepError:
                ops["mknod", "error"] += 1
                raise
        try:
            with _step(f"chown {path} to {want.uid}:{want.gid}"):
                os.chown(path, want.uid, want.gid, follow_symlinks=False)
            with _step(f"chmod {path} to {want.mode:#o}"):
                os.chmod(path, want.mode)
        except _StepError:
            ops["mknod", "error"] += 1
            self._discard(path, ops, quiet=True)
            raise
        ops["mknod", "ok"] += 1
        return standin

    def _ensure_dev_dir(self) -> None:
        with _step(f"create {self._dev_dir}"):
            if os.path.isdir(self._dev_dir):
                return
            os.makedirs(self._dev_dir, mode=DEV_DIR_MODE, exist_ok=True)
            os.chmod(self._dev_dir, DEV_DIR_MODE)

    def _discard(self, path: str, ops: Counter[tuple[str, str]], *, quiet: bool = False) -> None:
        """Remove a node left half made or half fixed: a wrong owner must not keep access."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError:
            ops["remove", "error"] += 1
            return
        if not quiet:
            ops["remove", "ok"] += 1

    def _remove_stale_nodes(
        self,
        keep: set[int],
        *,
        keep0: bool,
        ops: Counter[tuple[str, str]],
        problems: list[str],
    ) -> None:
        try:
            names = _entries(self._dev_dir)
        except OSError as exc:
            problems.append(f"cannot list {self._dev_dir}: {_reason(exc)}")
            return
        for name in names:
            match = _CHANNEL_NAME.fullmatch(name)
            if match is None:
                continue
            channel = int(match.group(1))
            canonical = name == f"channel{channel}"
            path = _inside(self._dev_dir, name)
            if canonical and (channel in keep or (channel == 0 and keep0 and _drivers(path))):
                continue
            self._remove(path, ops, problems)

    # --- hand-off files ---

    def _handoff(self, want: Want, major: int, ops: Counter[tuple[str, str]]) -> Refusal | None:
        """Write the want's CDI spec and env file; the first failure is its Refusal."""
        try:
            spec = json.dumps(cdi_spec(want, major=major, dev_dir=self._dev_dir), indent=2) + "\n"
            env = env_text(want)
        except ValueError as exc:
            return _refuse(want, CDI_WRITE_FAILED, str(exc))
        for folder, name, content, op, reason in (
            (self._cdi_dir, cdi_file_name(want.workload), spec, "cdi", CDI_WRITE_FAILED),
            (self._env_dir, env_file_name(want.workload), env, "env", ENV_WRITE_FAILED),
        ):
            try:
                changed = _write_handoff(folder, name, content)
            except (_StepError, FileWriteError, ValueError) as exc:
                ops[op, "error"] += 1
                return _refuse(want, reason, str(exc))
            if changed:
                ops[op, "ok"] += 1
        return None

    def _remove_stale_files(
        self,
        folder: str,
        *,
        keep: set[str],
        ours: Callable[[str], bool],
        ops: Counter[tuple[str, str]],
        problems: list[str],
    ) -> None:
        """Remove our files in `folder` not in `keep`, and temp files a killed write left."""
        try:
            names = _entries(folder)
        except OSError as exc:
            problems.append(f"cannot list {folder}: {_reason(exc)}")
            return
        for name in names:
            if name.startswith(".") and name.endswith(TEMP_SUFFIX):
                stem = name[1:].rsplit(".", 2)[0]
                if ours(stem):
                    with contextlib.suppress(OSError):
                        os.unlink(_inside(folder, name))
                continue
            if ours(name) and name not in keep:
                self._remove(_inside(folder, name), ops, problems)

    def _remove(self, path: str, ops: Counter[tuple[str, str]], problems: list[str]) -> None:
        """Unlink `path` (a symlink itself, never its target); a folder is a problem."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            ops["remove", "error"] += 1
            problems.append(f"cannot remove {path}: {_reason(exc)}")
            return
        ops["remove", "ok"] += 1

    def _channel0_open(self) -> bool:
        """Whether channel0 exists with o+r or o+w: any local process can open it."""
        try:
            # Followed on purpose: opening a symlink named channel0 opens its target.
            mode = os.stat(os.path.join(self._dev_dir, "channel0")).st_mode
        except OSError:
            return False
        return bool(mode & (stat.S_IROTH | stat.S_IWOTH))


def _spec_channel(path: str, workload: str) -> int | None:
    """The channel of our CDI spec at `path` for `workload`; None when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            spec = json.loads(file.read(1 << 16))
        devices = spec["devices"]
        if len(devices) != 1 or devices[0]["name"] != workload:
            return None
        minor = devices[0]["containerEdits"]["deviceNodes"][0]["minor"]
    except (OSError, ValueError, LookupError, TypeError):
        return None
    if isinstance(minor, int) and not isinstance(minor, bool) and 0 <= minor <= MAX_CHANNEL:
        return minor
    return None


def _write_handoff(folder: str, name: str, content: str) -> bool:
    """Write one CDI spec or env file atomically when it changed; return whether it did.

    Anything at the path that is not a regular file (a symlink, a device) is removed
    first: write_atomic would write through a symlink to its target.
    """
    path = _inside(folder, name)
    with _step(f"create {folder}"):
        if not os.path.isdir(folder):
            # Readable by all whatever the umask: a job running as its user reads the env file.
            os.makedirs(folder, mode=DEV_DIR_MODE, exist_ok=True)
            os.chmod(folder, DEV_DIR_MODE)
    with _step(f"stat {path}"):
        current = _lstat(path)
    if current is not None and not stat.S_ISREG(current.st_mode):
        with _step(f"remove {path} (not a regular file)"):
            os.unlink(path)
        current = None
    changed = write_atomic(path, content, mode=HANDOFF_MODE)
    if not changed and current is not None and stat.S_IMODE(current.st_mode) != HANDOFF_MODE:
        with _step(f"chmod {path} to {HANDOFF_MODE:#o}"):
            os.chmod(path, HANDOFF_MODE)
        changed = True
    return changed


DRIVER_CHANNEL0_MODE: Final = 0o666
"""How the driver makes channel 0 (NVreg_CreateImexChannel0=1): root's, world-writable."""


def _drivers(path: str) -> bool:
    """Whether the node at `path` is channel 0 as the driver makes it (root:root 0666),
    not one a finished workload was given: `keep_channel0` keeps only the driver's, so a
    job's channel 0 never outlives the job with the job's owner."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISCHR(info.st_mode)
        and os.minor(info.st_rdev) == 0
        and (info.st_uid, info.st_gid) == (0, 0)
        and stat.S_IMODE(info.st_mode) == DRIVER_CHANNEL0_MODE
    )
