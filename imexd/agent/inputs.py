"""What the node's core takes in (`NodeCore.feed`): each input is one thing that happened.

The driver (imexd.agent.run) makes them from the bus, the supervisor, discovery and its
own timers, and feeds each with the time; they are plain values, so a test makes them
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from imexd.bus.events import Event
from imexd.daemon.state import DaemonState


@dataclass(frozen=True, slots=True)
class BusInput:
    """A bus event that passed the control plane's order (`Rebuilder.on_event`)."""

    event: Event


@dataclass(frozen=True, slots=True)
class DaemonInput:
    """The supervisor's state moved."""

    state: DaemonState
    fatal_since: float | None = None


@dataclass(frozen=True, slots=True)
class Discovered:
    """NVML fabric discovery found this node's clique (and the driver's version)."""

    clique: str
    driver: str = ""
    reason: str = ""
    """Why discovery says this clique (logged when it changes)."""


@dataclass(frozen=True, slots=True)
class Surveyed:
    """The pid of a daemon of our config that runs without us (None: none)."""

    pid: int | None


@dataclass(frozen=True, slots=True)
class Proven:
    """The round trip of a `ProveLink` came back (`ok`) or not."""

    mark: int
    ok: bool


@dataclass(frozen=True, slots=True)
class Reconciled:
    """A reconcile round ended: applied (`probe_now`: nothing was given to a running
    daemon) or failed (to be tried again on the local backoff)."""

    ok: bool
    probe_now: bool = False


@dataclass(frozen=True, slots=True)
class Retarget:
    """Follow the target: leave the current shard and join the target one if they differ."""


@dataclass(frozen=True, slots=True)
class Step:
    """Step membership: an event batch came, or a timer (`next_due`) ran out."""

    channel_count: int | None = None
    """The driver's ImexChannelCount, for our member record (None: unknown)."""


Input = BusInput | DaemonInput | Discovered | Surveyed | Proven | Reconciled | Retarget | Step
