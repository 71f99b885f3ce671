"""The filters a bus's caller wants, and what the broker of the current link made of them.

A subscription the broker refuses (SUBACK failure) leaves a partial view: a clustered
broker (NATS 2.9) refuses some for a while after a server died, an ACL for good. So the
link tracks, per filter, whether it was granted or refused on this link; no `Synced`
covers a refused filter, and an echo that could only come through one is not awaited.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from imexd.bus.mqtt import topic_matches


def check_filter(topic_filter: str) -> None:
    """ValueError unless `topic_filter` is an MQTT topic filter."""
    levels = topic_filter.split("/")
    if not topic_filter or "#" in levels[:-1] or "\0" in topic_filter:
        raise ValueError(f"{topic_filter!r} is not a topic filter")
    if any(("+" in lv and lv != "+") or ("#" in lv and lv != "#") for lv in levels):
        raise ValueError(f"{topic_filter!r} is not a topic filter")


class Subscriptions:
    """Wanted filters (kept across links) and their grants and refusals on the current link.

    `ping_topic`, the link's own, is subscribed on every link but is not the caller's: a
    refusal of it counts like one of a wanted filter.
    """

    def __init__(self, ping_topic: str) -> None:
        self._ping_topic = ping_topic
        self.wanted: dict[str, bool] = {}
        """The caller's filters, in the order subscribed, each with whether the caller
        judges by the broker's one order of its messages (`ordered`: QoS 1 on every
        broker; `Bus.subscribe` says what the others get)."""
        self.dropped: set[str] = set()
        """Filters given up while no link was up: a resumed MQTT 5 session may hold them."""
        self.granted: set[str] = set()
        """Filters the broker granted on this link (what a `Synced` can cover)."""
        self.refused: dict[str, str] = {}
        """Filters (ours, or the ping topic) the broker refused on this link: the refusal."""
        self.changed = asyncio.Event()
        """Set when a subscription was refused (or a refused one dropped): retry, resync."""
        self.detail = ""
        """Which subscriptions the broker of this link refuses, naming it and them; ""
        when none (`Bus.subscribe_refused`)."""

    def add(self, filters: Iterable[str], *, ordered: bool = True) -> list[str]:
        """Want `filters` (each checked); the ones not wanted before, in order. A filter
        wanted again as `ordered` stays ordered from its next SUBSCRIBE on."""
        filters = list(filters)
        for topic_filter in filters:
            check_filter(topic_filter)
        new: list[str] = []
        for topic_filter in dict.fromkeys(filters):
            if topic_filter not in self.wanted:
                new.append(topic_filter)
                self.dropped.discard(topic_filter)
            self.wanted[topic_filter] = ordered or self.wanted.get(topic_filter, False)
        return new

    def ordered(self, topic_filter: str) -> bool:
        """Whether the caller judges by the order of `topic_filter`'s messages (a filter
        not wanted, the ping's, is not)."""
        return self.wanted.get(topic_filter, False)

    def remove(self, topic_filter: str) -> bool:
        """Stop wanting `topic_filter`; False when it was not wanted."""
        if topic_filter not in self.wanted:
            return False
        del self.wanted[topic_filter]
        self.granted.discard(topic_filter)
        if self.refused.pop(topic_filter, None) is not None:
            self.changed.set()  # maybe nothing is refused now: resync
        return True

    def link_up(self) -> None:
        """A new link: nothing granted or refused on it yet."""
        self.refused.clear()
        self.granted.clear()
        self.changed.clear()
        self.detail = ""

    def forget_dropped(self) -> list[str]:
        """The filters to unsubscribe on a resumed session: given up and not wanted again."""
        stale = sorted(self.dropped - set(self.wanted))
        self.dropped.clear()
        return stale

    def answered(
        self, broker: str, filters: Sequence[str], refusals: Sequence[str | None]
    ) -> list[tuple[str, str]]:
        """Note the broker's answer to a SUBSCRIBE of `filters`; (filter, refusal) of each
        refused one (then `changed` is set)."""
        refused: list[tuple[str, str]] = []
        for topic_filter, refusal in zip(filters, refusals, strict=True):
            if refusal is None:
                self.refused.pop(topic_filter, None)
                self.granted.add(topic_filter)
            else:
                self.refused[topic_filter] = refusal
                refused.append((topic_filter, refusal))
        self._describe(broker)
        if refused:
            self.changed.set()
        return refused

    def still_refused(self, broker: str) -> list[str]:
        """The refused filters still wanted (the caller may have dropped some)."""
        self.refused = {
            f: code for f, code in self.refused.items() if f == self._ping_topic or f in self.wanted
        }
        self._describe(broker)
        return list(self.refused)

    def covers(self, topic: str) -> bool:
        """Whether a wanted filter matches `topic`."""
        return any(topic_matches(f, topic) for f in self.wanted)

    def can_echo(self, topic: str) -> bool:
        """Whether a granted filter of ours covers `topic`, so that its echo can come."""
        return any(topic_matches(f, topic) for f in self.wanted if f not in self.refused)

    def _describe(self, broker: str) -> None:
        if not self.refused:
            self.detail = ""
            return
        refused = ", ".join(f"{f} (code {code})" for f, code in self.refused.items())
        self.detail = f"the broker {broker} refused our subscription to {refused}"
