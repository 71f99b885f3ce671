"""What a `Bus` tells its caller: the events of `Bus.events()`, and the Last Will it keeps.

A leaf of the bus package (no I/O, no MQTT library), so that the pure layers that read
these events (the shard, the rebuilder, the channel keeper) import them without the link.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from imexd.messages import Deleted, MemberRecord, Presence, Received, encode
from imexd.topics import TopicRef

SESSION_TAKEN_OVER: Final = 0x8E
"""MQTT 5 DISCONNECT reason: another client connected with our client id. Brokers that
send no reason code (MQTT 3.1.1, Mosquitto before 2.0.12) close the old link silently."""

Protocol = Literal["5", "3.1.1"]


class Connected(msgspec.Struct, frozen=True):
    """The link is up (CONNACK received); subscriptions and records are being replayed
    (those of `retain(replay=False)` are left to the caller, after `Synced`)."""

    broker: str
    protocol: Protocol
    will_delay: bool
    """Whether the will is delayed (MQTT 5); with 3.1.1 it fires at once."""
    repaired: bool = False
    """Whether this link gets the broker repairs (`imexd.bus.repairs`, `[bus] broker`):
    its broker may reorder or lose messages, so no record on it proves incumbency."""
    link: int = 0
    """This link's number, counted from 1 by the bus (every connect attempt takes one): the
    Last Will of this link says it (`MemberRecord.link`), so records published on it are
    ordered before that will and after the will of any earlier link."""


DELIBERATE_REASONS: Final = frozenset({"closed", "will changed", "client id changed"})
"""`Disconnected.reason` of links the bus ended itself."""


class Disconnected(msgspec.Struct, frozen=True):
    """The link is down; the bus reconnects by itself."""

    broker: str
    reason: str
    reason_code: int | None = None
    """The reason code of the broker's DISCONNECT (MQTT 5 only), e.g. 0x8E; None when
    the broker sent none (MQTT 3.1.1, a dead link, or our own clean leave)."""

    @property
    def taken_over(self) -> bool:
        """Whether another client connected with our client id (a duplicate agent, or a
        restarted one); only MQTT 5 brokers say so."""
        return self.reason_code == SESSION_TAKEN_OVER

    @property
    def deliberate(self) -> bool:
        """Whether the bus itself ended the link: closing, or reconnecting on purpose to
        install another will or client id (not a failure, not a reconnect to count)."""
        return self.reason in DELIBERATE_REASONS


class ConnectFailed(msgspec.Struct, frozen=True):
    """An attempt to connect failed (also `last_error`); the bus tries again by itself.

    Lets the agent say why BusConnected is False without polling.
    """

    broker: str
    error: str


class Synced(msgspec.Struct, frozen=True):
    """Every retained message of the current subscriptions was delivered before this.

    Emitted after each connect, and after each `subscribe()` while connected.
    """

    at: float
    """time.monotonic() when the snapshot was complete."""
    filters: frozenset[str] | None = None
    """The filters whose snapshot it proves: those granted on this link before its round
    trip began (None: not said). A filter subscribed meanwhile has its own Synced."""


class Refused(msgspec.Struct, frozen=True):
    """Our retained publication did not come back in time: the broker refused it (ACL),
    or a clustered broker lost its echo (the shard publishes a claim again then)."""

    topic: str
    detail: str
    ref: TopicRef | None = None
    """What the topic addresses (None: not an imexd topic)."""
    repaired: bool = False
    """The link may lose an echo (a repaired link: `Connected.repaired`; a three-server
    NATS 2.9 cluster was seen to keep a claim and never deliver its echo to the claimant);
    elsewhere (Mosquitto over MQTT 5) a missing echo is a refusal or an overloaded agent,
    and publishing again would only add load."""


class EchoLost(msgspec.Struct, frozen=True):
    """Our retained publication was kept by the broker (a snapshot held it) but its live
    echo did not come in time: a clustered broker lost the echo. Not a refusal; the shard
    publishes a claim again on a link that may lose updates (as for `Refused`)."""

    topic: str
    ref: TopicRef | None = None
    repaired: bool = False


class SubscribeRefused(msgspec.Struct, frozen=True):
    """The broker refused a subscription we need (SUBACK failure): the bus subscribes it
    again with backoff, then drops the link for the next broker; no `Synced` meanwhile."""

    broker: str
    topic_filter: str
    code: str
    """The broker's refusal (e.g. "128", or an MQTT 5 reason such as "Not authorized")."""
    detail: str
    """What `Bus.subscribe_refused` says: naming the broker and every refused filter."""


SUBSCRIBE_REFUSED: Final = "SubscribeRefused"
"""The reason BusConnected gives while a subscription we need is refused."""

NO_RETAINED_WILDCARD: Final = "BrokerNoRetainedWildcard"
"""The check's failure where the broker serves our record to a subscription of its own
topic only (`imexd.bus.check`)."""
RETAINED_NOT_SERVED: Final = "BrokerRetainedNotServed"
"""The check's failure where the broker does not serve our record at all."""


class BrokerChecked(msgspec.Struct, frozen=True):
    """Whether the broker delivered our own record, flagged retained, to a new wildcard
    subscription (checked once per link, after the record first came back live)."""

    broker: str
    ok: bool
    detail: str = ""
    """Why not, naming the broker; "" when ok."""


Event = (
    Connected
    | Disconnected
    | ConnectFailed
    | Synced
    | EchoLost
    | Received
    | Deleted
    | Refused
    | BrokerChecked
    | SubscribeRefused
)


class WillSpec(msgspec.Struct, frozen=True):
    """The Last Will, retained (QoS 1) on `topic`: the agent's presence marked lost
    (`messages.Presence`), with the link it ends and its `hold_s` set per link; a member
    record's tombstone (state lost) likewise; or an empty payload without one.

    The broker publishes it when the link ends without DISCONNECT, after `delay_s`
    (MQTT 5 Will Delay; None: `BusSettings.will_delay_s`) so that a quick reconnect does not
    flap membership. Where the broker does not wait (3.1.1, or `[bus] broker_will_delay =
    false`), the tombstone's hold_s is the delay: the peers wait instead.
    """

    topic: str
    delay_s: float | None = None
    tombstone: MemberRecord | Presence | None = None

    def payload(self, delay_s: float, *, broker_waits: bool, link: int = 0) -> bytes:
        """The will's payload on link number `link` (`Connected.link`), whose broker waits
        the Will Delay, or not."""
        if self.tombstone is None:
            return b""
        hold_s = 0.0 if broker_waits else float(delay_s)
        return encode(msgspec.structs.replace(self.tombstone, hold_s=hold_s, link=link))
