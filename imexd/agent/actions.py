"""What the node's core asks for: actions for the driver to carry out, in order, and the
next move of a reconcile round.

Plain values: the driver (imexd.agent.run) turns each into its I/O (a publish, a
subscription, a saved file, a reconcile), and a test reads them as they are. A stop,
restart or retry of the daemon is no action here: it is an order of the daemon's gate
(imexd.agent.gate), carried out by the reconciler only.
"""

from __future__ import annotations

import msgspec

from imexd.agent.gate import DaemonOrder
from imexd.bus.events import WillSpec
from imexd.membership.desired import Desired
from imexd.messages import Payload
from imexd.nodestate import NodeState


class Publish(msgspec.Struct, frozen=True):
    """Retain `payload` on `topic` (None: clear it); `replay=False`: not again on a new
    link by the bus (the core publishes a member record there itself)."""

    topic: str
    payload: Payload | None
    replay: bool = True


class Clear(msgspec.Struct, frozen=True):
    """Clear our records on `topics`, under the report lock: no report follows a clear."""

    topics: tuple[str, ...]


class Subscribe(msgspec.Struct, frozen=True):
    filters: tuple[str, ...]
    ordered: bool = True


class Unsubscribe(msgspec.Struct, frozen=True):
    filters: tuple[str, ...]


class SetWill(msgspec.Struct, frozen=True):
    will: WillSpec | None


class SetClientId(msgspec.Struct, frozen=True):
    client_id: str


class Disown(msgspec.Struct, frozen=True):
    """A topic of ours that another agent of our name writes: neither replayed nor put back."""

    topic: str


class SaveState(msgspec.Struct, frozen=True):
    state: NodeState


class Follow(msgspec.Struct, frozen=True):
    """The channels and the control plane's records follow this domain (and clique)."""

    domain: str | None
    clique: str | None


class Survey(msgspec.Struct, frozen=True):
    """Look for a daemon of our config that runs without us; feed back `Surveyed`."""


class Reconcile(msgspec.Struct, frozen=True):
    """What should run changed, or an operator asked for a retry: reconcile."""


class StepSoon(msgspec.Struct, frozen=True):
    """Step membership again without waiting for an event."""


class ProbeNow(msgspec.Struct, frozen=True):
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


class Pause(msgspec.Struct, frozen=True):
    """Wait until `until`, then ask again."""

    until: float


class ProveLink(msgspec.Struct, frozen=True):
    """Make one round trip through the broker; feed back `Proven(mark, ok)`."""

    mark: int


class AwaitView(msgspec.Struct, frozen=True):
    """The link dropped: wait (bounded) for membership to step on the resynced snapshot."""


class Apply(msgspec.Struct, frozen=True):
    """Write the files `desired` implies and bring the daemon in line (the `Reconciler`),
    after carrying out `retry` when an operator asked for one."""

    desired: Desired
    saved: NodeState
    retry: DaemonOrder | None = None


RoundStep = Pause | ProveLink | AwaitView | Apply
