"""What the link checks of the control plane's records before anyone reads them.

With `[control] public_key` a spec, workload, assignment or retry request is delivered
only when the control key signed it on its topic (`imexd.signing`); the rest is dropped
and counted (`unsigned`, `signature`), so nothing downstream ever sees a record the
control plane did not write.

A clear (an empty payload) cannot be signed, and needs no check here: no reader applies
one. The agent's order (`imexd.agent.rebuild`) answers a clear of a record it holds with
that record at once (the control plane deletes with a signed tombstone), so a forged
clear removes nothing and is undone within a round trip.

`standing` names the topics where the broker holds what does not verify, for the
BusConnected condition (`UnverifiedRecords`): a record that does not verify stands until
a verified record or a clear replaces it (a new link's snapshot says again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from imexd.messages import Deleted, Dropped, DropReason, Received
from imexd.signing import SIGNED_KINDS, Verifier

MAX_TOPICS: Final = 4096
"""Standing topics remembered at most; past it no more are added."""


class Signatures:
    """The check of one bus: `check` every decoded message of the link."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self.fingerprint = verifier.fingerprint
        """Of the key records are verified with (HealthReport `control_key`)."""
        self.standing: dict[str, str] = {}
        """Topic -> the DropReason value of what stands there unverified."""

    def check(self, message: Received | Deleted) -> Received | Deleted | Dropped:
        """`message` when it may be delivered, else why it is dropped."""
        ref, topic = message.ref, message.topic
        if ref.kind not in SIGNED_KINDS:
            return message
        if isinstance(message, Deleted):
            self.standing.pop(topic, None)
            return message
        problem = self.verifier.problem(topic, message.data)
        if problem is not None:
            reason, detail = problem
            self._stand(topic, reason)
            return Dropped(DropReason(reason), detail)
        self.standing.pop(topic, None)
        return message

    def link_up(self) -> None:
        """A new link: its snapshot says again which records do not verify."""
        self.standing = {}

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Stop tracking topics no longer covered by our subscriptions."""
        self.standing = {t: why for t, why in self.standing.items() if keep(t)}

    def _stand(self, topic: str, why: str) -> None:
        if topic not in self.standing and len(self.standing) >= MAX_TOPICS:
            return
        self.standing[topic] = why
