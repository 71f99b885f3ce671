"""What the link checks of the control plane's records before anyone reads them.

With `[control] public_key` a spec, workload, assignment or retry request is delivered
only when the control key signed it on its topic (`imexd.signing`); the rest is dropped
and counted (`unsigned`, `signature`), so nothing downstream ever sees a record the
control plane did not write.

A clear (an empty payload) cannot be signed. The control plane retires a record with a
signed record first (a spec `deleting`, an assignment to no domain, a workload record
`claiming` on no node) and clears it after; so a clear is delivered only when the last
verified record of its topic retired it, and a clear alone removes nothing: it is
dropped (`unsigned_clear`) while the record it would remove stands. Clears of retry
requests are delivered (the agent acts on requests, never on their absence).

`standing` names the topics where the broker holds what does not verify, for the
BusConnected condition (`UnverifiedRecords`): a record that does not verify stands until
a verified record or a clear replaces it (a new link's snapshot says again), a clear of
a live record until a verified record comes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from imexd.messages import (
    Assignment,
    Deleted,
    DomainSpec,
    Dropped,
    DropReason,
    Payload,
    Received,
    WorkloadRecord,
)
from imexd.signing import SIGNED_KINDS, Verifier

MAX_TOPICS: Final = 4096
"""Topics remembered (verified records, standing ones); past it the oldest go first."""
CLEAR_KEPT: Final = (
    "a clear without a signed deletion before it: the agent keeps the record the control "
    "plane signed"
)


def retires(payload: Payload) -> bool:
    """Whether a verified record takes back what its topic gave: a spec being deleted or
    deleted, an assignment to no domain, a workload record that is not active (agents
    make no channel for it)."""
    if isinstance(payload, DomainSpec):
        return payload.state != "active"
    if isinstance(payload, Assignment):
        return payload.domain is None
    if isinstance(payload, WorkloadRecord):
        return payload.state != "active"
    return False


class Signatures:
    """The check of one bus: `check` every decoded message of the link."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self.fingerprint = verifier.fingerprint
        """Of the key records are verified with (HealthReport `control_key`)."""
        self._retired: dict[str, bool] = {}
        """Topic -> whether its last verified record retires it (`retires`)."""
        self.standing: dict[str, str] = {}
        """Topic -> the DropReason value of what stands there unverified."""

    def check(self, message: Received | Deleted) -> Received | Deleted | Dropped:
        """`message` when it may be delivered, else why it is dropped."""
        ref, topic = message.ref, message.topic
        if ref.kind not in SIGNED_KINDS:
            return message
        if isinstance(message, Deleted):
            return self._cleared(message)
        problem = self.verifier.problem(topic, message.data)
        if problem is not None:
            reason, detail = problem
            self._stand(topic, reason)
            return Dropped(DropReason(reason), detail)
        self.standing.pop(topic, None)
        self._remember(topic, retires(message.payload))
        return message

    def _cleared(self, message: Deleted) -> Deleted | Dropped:
        topic = message.topic
        self.standing.pop(topic, None)
        if message.ref.kind != "retry" and self._retired.get(topic) is False:
            self._stand(topic, DropReason.UNSIGNED_CLEAR.value)
            return Dropped(DropReason.UNSIGNED_CLEAR, CLEAR_KEPT)
        self._retired.pop(topic, None)
        return message

    def link_up(self) -> None:
        """A new link: its snapshot says again which records do not verify; a clear of a
        live record stays standing (nothing comes to say it again)."""
        self.standing = {
            t: why for t, why in self.standing.items() if why == DropReason.UNSIGNED_CLEAR.value
        }

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Stop tracking topics no longer covered by our subscriptions."""
        self.standing = {t: why for t, why in self.standing.items() if keep(t)}
        self._retired = {t: r for t, r in self._retired.items() if keep(t)}

    def _remember(self, topic: str, retired: bool) -> None:
        self._retired.pop(topic, None)
        if len(self._retired) >= MAX_TOPICS:
            del self._retired[next(iter(self._retired))]
        self._retired[topic] = retired

    def _stand(self, topic: str, why: str) -> None:
        if topic not in self.standing and len(self.standing) >= MAX_TOPICS:
            return
        self.standing[topic] = why
