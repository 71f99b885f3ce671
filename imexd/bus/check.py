"""The retained-wildcard check: may this broker's snapshots be trusted at all?

A snapshot only means something when the broker sends retained messages to wildcard
subscriptions; RabbitMQ's MQTT plugin (3.10) sends them only to subscriptions that name
the topic exactly, so its agents would each see an empty shard and all report ready,
each alone. So once our own record came back live on a link, the link subscribes a
wildcard filter that matches it again and expects it back, flagged retained, before a
round trip returns; until a link passes, no `Synced` (docs/bus.md, *Connection*).

Which filter: on a repaired link (`imexd.bus.repairs`) the shard's own filter, read again
like a re-read (nats-server 2.9 sometimes grants a reconnecting client's first SUBSCRIBE
without the retained messages, and this second read completes its view before any claim
counts); a re-read without our record proves nothing (a broker may send no retained
copies again for a filter it already granted: `bus_resync_empty`), so the check then asks
as below, with a filter the broker has not granted yet. Elsewhere that second read would
send every record of the shard again, k messages to each of k nodes, so the check's own
filter, which matches our record only, is subscribed at QoS 0 and dropped at once, under
the bus lock: no record of ours is published while it overlaps the shard's (its echo
would come once per matching subscription, and a second echo could pass for a later
record's). A refusal of that filter gives no verdict on the link. A failure then reads our
record's own topic the same way, to name which: the broker serves it there
(`BrokerNoRetainedWildcard`), or nowhere (`BrokerRetainedNotServed`: a NATS cluster of
2.10.11 or later after the server holding this server's retained feed died,
docs/brokers.md). On a repaired link a failed check is asked again, then the link moves
(`imexd.bus.engine.LinkEngine._check_failed`).

The link (`imexd.bus.engine`) does the subscribing; this module holds which filter to use,
what was seen, and the verdict.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

from imexd.bus.events import NO_RETAINED_WILDCARD, RETAINED_NOT_SERVED, BrokerChecked
from imexd.bus.mqtt import topic_matches

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger


def check_filters(record_topic: str, wanted: Iterable[str]) -> tuple[str, str] | None:
    """(a wanted wildcard filter covering `record_topic`, the check's own filter), or None
    when no wanted filter covers it.

    The check's own filter matches that one topic only: `{p}/domains/D/+/C/N` for the
    member topic `{p}/domains/D/members/C/N` (no other kind of topic has three levels
    under a domain)."""
    for topic_filter in wanted:
        if topic_filter != record_topic and topic_matches(topic_filter, record_topic):
            levels = record_topic.split("/")
            if len(levels) < 3:
                return None
            levels[-3] = "+"  # {p}/domains/D/members/C/N -> {p}/domains/D/+/C/N
            return topic_filter, "/".join(levels)
    return None


class RetainedCheck:
    """The check's state over a bus's links, and its verdict."""

    def __init__(self) -> None:
        self.failed = ""
        """Why the broker cannot be trusted with the retained snapshot; "" while no link
        failed the check since one passed it (`Bus.no_retained_wildcard`)."""
        self.reason = ""
        """`NO_RETAINED_WILDCARD` or `RETAINED_NOT_SERVED` while `failed` is set, else ""."""
        self.passed = False
        """The current link passed the check (`Bus.retained_checked`)."""
        self.own_echo = asyncio.Event()
        """Set when our own record came back live on this link: the check may run."""
        self.withheld = False
        """A snapshot completed while the broker was not trusted: `Synced` once it is."""
        self._topic: str | None = None
        self._seen = False
        self.narrow = False
        """The check reads its own filter (not the shard's): the copy it brings is not news."""

    def link_up(self) -> None:
        """A new link: nothing checked on it yet."""
        self.own_echo = asyncio.Event()
        self.passed = False
        self.withheld = False

    def begin(self, record_topic: str, *, narrow: bool) -> None:
        """The check's subscription goes out (`narrow`: its own filter): watch for our
        record's retained copy."""
        self._topic, self._seen, self.narrow = record_topic, False, narrow

    @property
    def seen(self) -> bool:
        """The check's read brought our record's retained copy."""
        return self._seen

    def end(self) -> None:
        self._topic = None

    def saw(self, topic: str, *, retained: bool) -> bool:
        """A message on our record's topic arrived; whether it is the copy the check
        waits for."""
        if retained and topic == self._topic:
            self._seen = True
            return True
        return False

    def verdict(
        self,
        broker: str,
        topic_filter: str,
        log: FilteringBoundLogger,
        *,
        seen: bool,
        served: bool | None,
    ) -> BrokerChecked:
        """The verdict of the check that just ended (`seen`: our copy came), logged on a
        change. A failure is one of two, told apart by a read of our record's own topic
        (`served`; None when not asked): a broker that serves retained messages only to a
        subscription naming their topic (RabbitMQ's plugin, `NO_RETAINED_WILDCARD`), or
        one that does not serve our record at all (`RETAINED_NOT_SERVED`): a NATS cluster
        of 2.10.11 or later whose server holding this one's retained feed died
        (docs/brokers.md)."""
        if seen:
            self.passed = True
            if self.failed:
                log.info("bus_retained_wildcard_ok", broker=broker)
            self.failed = self.reason = ""
            return BrokerChecked(broker, ok=True)
        if served is False:
            reason = RETAINED_NOT_SERVED
            detail = (
                f"the broker {broker} did not send our retained record back to a new "
                f"subscription of {topic_filter}, nor to one of its own topic: it does not "
                "serve a retained record it took, so the member snapshot cannot be trusted "
                "(a NATS cluster of 2.10.11 or later does so once the server that held this "
                "server's retained feed died, until that server is back)"
            )
        else:
            reason = NO_RETAINED_WILDCARD
            detail = (
                f"the broker {broker} did not send our retained record back to a new "
                f"subscription of {topic_filter}: it does not deliver retained messages to "
                "wildcard subscriptions, so the member snapshot cannot be trusted"
            )
        if not self.failed:
            log.warning("bus_broker_check_failed", reason=reason, broker=broker, detail=detail)
        self.failed, self.reason = detail, reason
        return BrokerChecked(broker, ok=False, detail=detail)
