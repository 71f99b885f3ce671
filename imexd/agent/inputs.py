"""What the node's core takes in (`NodeCore.feed`): each input is one thing that happened.

The driver (imexd.agent.run) makes them from the bus, the supervisor, discovery and its
own timers, and feeds each with the time; they are plain values, so a test makes them
the same way.
"""

from __future__ import annotations

import msgspec

from imexd.bus.events import Event
from imexd.daemon.state import DaemonState


class BusInput(msgspec.Struct, frozen=True):
    """A bus event that passed the control plane's order (`Rebuilder.on_event`)."""

    event: Event


class DaemonInput(msgspec.Struct, frozen=True):
    """The supervisor's state moved."""

    state: DaemonState
    fatal_since: float | None = None


class Discovered(msgspec.Struct, frozen=True):
    """NVML fabric discovery found this node's clique (and the driver's version)."""

    clique: str
    driver: str = ""
    reason: str = ""
    """Why discovery says this clique (logged when it changes)."""


class Surveyed(msgspec.Struct, frozen=True):
    """The pid of a daemon of our config that runs without us (None: none)."""

    pid: int | None


class Proven(msgspec.Struct, frozen=True):
    """The round trip of a `ProveLink` came back (`ok`) or not."""

    mark: int
    ok: bool


class Reconciled(msgspec.Struct, frozen=True):
    """A reconcile round ended: applied (`probe_now`: nothing was given to a running
    daemon) or failed (to be tried again on the local backoff)."""

    ok: bool
    probe_now: bool = False


class Retarget(msgspec.Struct, frozen=True):
    """Follow the target: leave the current shard and join the target one if they differ."""


class Step(msgspec.Struct, frozen=True):
    """Step membership: an event batch came, or a timer (`next_due`) ran out."""

    channel_count: int | None = None
    """The driver's ImexChannelCount, for our member record (None: unknown)."""


Input = BusInput | DaemonInput | Discovered | Surveyed | Proven | Reconciled | Retarget | Step
