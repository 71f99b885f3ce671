"""What the node's core asks for: actions for the driver to carry out, in order, and the
next move of a reconcile round.

Plain values: the driver (imexd.agent.run) turns each into its I/O (a publish, a
subscription, a saved file, a reconcile), and a test reads them as they are. A stop,
restart or retry of the daemon is no action here: it is an order of the daemon's gate
(imexd.agent.gate), carried out by the reconciler only.
"""

from __future__ import annotations

from dataclasses import dataclass

from imexd.agent.gate import DaemonOrder
from imexd.bus.events import WillSpec
from imexd.membership.desired import Desired
from imexd.messages import Payload
from imexd.nodestate import NodeState


@dataclass(frozen=True, slots=True)
class Publish:
    """Retain `payload` on `topic` (None: clear it); `replay=False`: not again on a new
    link by the bus (the core publishes a member record there itself)."""

    topic: str
    payload: Payload | None
    replay: bool = True


@dataclass(frozen=True, slots=True)
class Clear:
    """Clear our records on `topics`, under the report lock: no report follows a clear."""

    topics: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Subscribe:
    filters: tuple[str, ...]
    ordered: bool = True


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    filters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SetWill:
    will: WillSpec | None


@dataclass(frozen=True, slots=True)
class SetClientId:
    client_id: str


@dataclass(frozen=True, slots=True)
class Disown:
    """A topic of ours that another agent of our name writes: neither replayed nor put back."""

    topic: str


@dataclass(frozen=True, slots=True)
class SaveState:
    state: NodeState


@dataclass(frozen=True, slots=True)
class Follow:
    """The channels and the control plane's records follow this domain (and clique)."""

    domain: str | None
    clique: str | None


@dataclass(frozen=True, slots=True)
class Survey:
    """Look for a daemon of our config that runs without us; feed back `Surveyed`."""


@dataclass(frozen=True, slots=True)
class Reconcile:
    """What should run changed, or an operator asked for a retry: reconcile."""


@dataclass(frozen=True, slots=True)
class StepSoon:
    """Step membership again without waiting for an event."""


@dataclass(frozen=True, slots=True)
class ProbeNow:
    """Ask the daemon's ctl now (nothing was given to a running daemon)."""


Action = (
    Publish
    | Clear
    | Subscribe
    | Unsubscribe
    | SetWill
    | SetClientId
    | Disown
    | SaveState
    | Follow
    | Survey
    | Reconcile
    | StepSoon
    | ProbeNow
)


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait until `until`, then ask again."""

    until: float


@dataclass(frozen=True, slots=True)
class ProveLink:
    """Make one round trip through the broker; feed back `Proven(mark, ok)`."""

    mark: int


@dataclass(frozen=True, slots=True)
class AwaitView:
    """The link dropped: wait (bounded) for membership to step on the resynced snapshot."""


@dataclass(frozen=True, slots=True)
class Apply:
    """Write the files `desired` implies and bring the daemon in line (the `Reconciler`),
    after carrying out `retry` when an operator asked for one."""

    desired: Desired
    saved: NodeState
    retry: DaemonOrder | None = None


RoundStep = Pause | ProveLink | AwaitView | Apply
