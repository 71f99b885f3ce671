"""The settings every simulated view is built with, the fault model's bounds, and the
oracle's bounds, each derived from those two so that a change of one moves the others.

Seconds of the simulated clock throughout. The view's settings follow the product's
defaults ([domain] settle_s, claim_stale_s, [bus] will_delay_s, reconnect_initial_s)
except `[bus] reconnect_max_s`, cut from 30 s to 8 s so that a schedule of a few dozen
steps sees reconnects, will delays and confirmation graces overlap.
"""

from __future__ import annotations

import inspect
from typing import Final

from imexd.bus.link import Bus
from imexd.health.guard import BEAT_S
from imexd.membership.shard import CONFIRM_MARGIN_S, TAKEOVER_WATCH_DELAYS

__all__ = ["BEAT_S"]

DOMAIN: Final = "sim"
CLIQUE: Final = "c1"
WALL_ORIGIN: Final = 1_700_000_000.0
"""The wall clock (settle stamps) when the simulated monotonic clock reads 0."""

# -- the settings the views are built with (ShardView.from_settings does the same sums)

SETTLE_S: Final = 0.2
"""`[domain] settle_s` (default)."""
CLAIM_STALE_S: Final = 30.0
"""`[domain] claim_stale_s` (default)."""
WILL_DELAY_S: Final = 5.0
"""`[bus] will_delay_s` (default): the broker's Will Delay, or on MQTT 3.1.1 the
will's hold_s."""
RECONNECT_INITIAL_S: Final = 0.5
"""`[bus] reconnect_initial_s` (default)."""
RECONNECT_MAX_S: Final = 8.0
"""`[bus] reconnect_max_s` (30 s by default): the cap of the reconnect backoff."""
CONFIRM_GRACE_S: Final = RECONNECT_MAX_S + CONFIRM_MARGIN_S
ECHO_TIMEOUT_S: Final[float] = inspect.signature(Bus).parameters["echo_timeout_s"].default
"""The bus's echo timeout (the agent's default): the longest the agent waits for the
snapshot of the presence topics it begins to follow (`Presences._read`)."""
TAKEOVER_WATCH_S: Final = TAKEOVER_WATCH_DELAYS * RECONNECT_INITIAL_S + CONFIRM_MARGIN_S

# -- the fault model: how late things may be

HOP_S: Final = (0.0005, 0.005)
"""The usual one-way delay of a message between an agent and the broker (a LAN)."""
SPIKE_S: Final = (0.02, 0.4)
"""A delivery that is late (a busy broker or agent): drawn for a seeded share of them."""
SLOW_MAX_S: Final = 1.5
"""The most a `slow` fault adds to every delivery to one node while it lasts."""
DETECT_MAX_S: Final = 1.5
"""The longest the broker takes to notice that a link died (a reset, or keepalive)."""
CLIENT_DETECT_MAX_S: Final = 3.0
"""The longest an agent takes to notice that its link died (its ping's timeout)."""
CONNECT_TIMEOUT_S: Final = 1.0
"""How long a connect to a broker that is down, or through a cut network, takes to fail."""
LINK_DOWN_MAX_S: Final = 12.0
"""The longest a `drop` cuts a node's network; longer than the Will Delay, so wills fire."""
BROKER_DOWN_MAX_S: Final = 6.0
"""The longest a broker restart keeps the broker away."""

# -- the oracle's bounds

DELIVERY_BOUND_S: Final = SLOW_MAX_S + SPIKE_S[1] + 2 * HOP_S[1]
"""The latest a message accepted by the broker reaches a connected subscriber."""
APPLY_BOUND_S: Final = 2 * SETTLE_S + 4 * DELIVERY_BOUND_S + BEAT_S + 0.5
"""From a change in a node's view to its hosts file: a step that waits for the snapshot
of the presence topics it began to follow (a round trip), the reconcile loop's settle
window (a removal waits it, then a round trip proves it, at most BEAT_S before the loop
goes on without it), and a margin."""
GONE_BOUND_S: Final = DETECT_MAX_S + WILL_DELAY_S + DELIVERY_BOUND_S + APPLY_BOUND_S
"""After a node crashed (or left while its link was down), the latest it is out of the
hosts file of every peer whose link stayed up: the broker notices, waits the Will Delay
(or the peers hold its record that long after the will), delivers the will, and the
peers apply it."""
REJOIN_BOUND_S: Final = CONFIRM_GRACE_S + WILL_DELAY_S + APPLY_BOUND_S
"""After a peer's link came back (its Synced), the latest a node that died meanwhile is
out of its hosts file: a record the new snapshot lacks stays for the confirmation grace,
a will that comes live after it is held for hold_s (MQTT 3.1.1), then the change is
applied."""
QUIET_S: Final = (
    RECONNECT_MAX_S
    + CONNECT_TIMEOUT_S
    + DETECT_MAX_S
    + CLIENT_DETECT_MAX_S
    + TAKEOVER_WATCH_S
    + CONFIRM_GRACE_S
    + WILL_DELAY_S
    + 20 * DELIVERY_BOUND_S
)
"""The quiet period after the last fault ended, before every live node must agree: a
last reconnect after its longest backoff, a watch of a record of a node's own name that
it did not write, the confirmation grace of records a new link lacks, a Will Delay, and
rounds of claims."""
