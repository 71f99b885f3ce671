"""When the reconciler applies what should run: the pacing of its rounds, pure.

Leading edge: the first change after a quiet period is applied at once; what follows
within `[domain] settle_s` of a round that wrote or signalled is coalesced into one write
and one signal (the supervisor's SIGUSR1 pacing makes sure the last change reaches the
daemon). A member moved or gone is applied only once that stood for settle_s, so that a
change its owner undid (a record written over and put back) reaches no daemon, and only
after a round trip through the broker, begun after the deletion came, proved the link: a
broker shutting down publishes every will, then drops the link. A deletion that comes
during the round trip waits for the next one; a round trip that did not come back proves
nothing, and another is made settle_s later on the link the view is synced on. Newcomers
do not wait. A failed round is tried again on the local backoff.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from imexd.agent.actions import AwaitView, Pause, ProveLink
from imexd.membership.desired import Desired
from imexd.retry import backoff_delay

LOCAL_RETRY_S: Final = (0.5, 30.0)
"""(first, longest) wait before a failed local action is tried again: a reconcile round
(a file that cannot be written) and an NVML discovery (at most `[node]
discover_interval_s`). It doubles after each failure, jittered (`imexd.retry`), so a
fault that clears is soon noticed and one that stays costs little."""


def removes_members(desired: Desired, applied: Mapping[int, str] | None) -> bool:
    """Whether `desired` drops a member the daemon was last given (a will, a leave);
    `applied`: slot -> address as last applied (None: nothing runs)."""
    if applied is None or not desired.run:
        return False
    kept = {slot: m.address for slot, m in desired.members.items()}
    return any(kept.get(slot) != address for slot, address in applied.items())


class Rounds:
    """The reconcile rounds' clock-free pacing: each call says what a round does next."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self.quiet_at = 0.0
        """`now` from which a change is applied at once (settle_s after the last round)."""
        self.proved = False
        """The round in progress made its round trip through the broker."""
        self.mark = 0
        """The deletions that round trip began after (`mark`): a later one it cannot prove."""
        self.retry_at: float | None = None
        """`now` at which a failed round is tried again (None: none failed)."""
        self.attempt = 0

    def next(
        self,
        now: float,
        *,
        removes: bool,
        changed_at: float,
        unproven: bool,
        mark: Callable[[], int],
        view_ready: bool,
    ) -> Pause | ProveLink | AwaitView | None:
        """What the round in progress does before it applies (None: apply now).

        `removes`: what should run drops a member the daemon was given; `changed_at`: when
        it last changed; `unproven`: deletions no round trip came back after yet (`mark`
        numbers them); `view_ready`: membership stepped on the current synced snapshot.
        """
        if self.quiet_at > now:
            return Pause(self.quiet_at)
        if self.proved and unproven and mark() > self.mark:
            # Deletions came during the round trip: only one begun after them proves them.
            self.proved = False
        if removes and not self.proved and changed_at + self.settle_s > now:
            return Pause(changed_at + self.settle_s)
        if not view_ready:
            # The link dropped: what membership saw just before may be a broker's
            # shutdown (it publishes every will first), and a proof holds for the link it
            # was made on. Apply what the view says once it stepped on the resynced
            # snapshot, proved again there.
            self.proved = False
            return AwaitView()
        if (removes or unproven) and not self.proved:
            self.proved = True
            self.mark = mark()
            return ProveLink(self.mark)
        self.proved = False
        self.quiet_at = now + self.settle_s
        return None

    def proven(self, ok: bool, now: float) -> None:
        """The round trip came back (`ok`) or not. One that did not proves nothing, though
        the link may still be up (a round trip that timed out): the round pauses settle_s,
        for a broker's shutdown to reach the view or a dead link to be declared dead,
        and proves again."""
        if not ok:
            self.proved = False
            self.quiet_at = now + self.settle_s

    def ended(self, *, ok: bool, probe_now: bool, now: float) -> None:
        """A round ended: a failed one is tried again on the local backoff; after one that
        gave a running daemon nothing, there is no burst to coalesce."""
        if not ok:
            self.retry_at = now + backoff_delay(self.attempt, *LOCAL_RETRY_S)
            self.attempt += 1
            return
        self.retry_at, self.attempt = None, 0
        if probe_now:
            self.quiet_at = 0.0
