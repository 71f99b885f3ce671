"""The node's decisions without I/O: inputs in, with the time; actions out.

`NodeCore` is one object per agent. The driver (imexd.agent.run) feeds it what happened,
each with the time (`now`: time.monotonic(); `wall`: Unix seconds): a bus event, the
daemon's state, a fabric discovery, a survey's or a link proof's result, a reconcile
round's outcome, a timer. It returns actions for the driver to carry out in order:
publish or clear our records, subscribe, change the will or the client id, save the
node's state, look for a daemon nobody supervises, reconcile, step again. Nothing here
awaits, reads a clock, or touches the broker, a file or a process, so every decision
is tested by feeding inputs with explicit times (tests/test_core.py).

What it decides:
- the target (domain, clique): static or assigned, and the clique known; a new target
  leaves the old shard (its records cleared, its filters dropped) and joins the new one;
- the membership step: it drives the shard view's protocol (`apply` each event, then
  `derive`, `sending`, `sent`, `commit`) and turns its plan into actions: publish the
  claim, save the state, leave a deleted domain, survey while standing aside;
- the release of a FATAL daemon's slot (latched for `claim_stale_s`), an operator's
  retry request, which peers' presences a claim waits for (`Followed`, in `presences`);
- `Desired`, what should run, and when the reconciler applies it (`reconcile_next`:
  the first change at once, what follows within `settle_s` coalesced, a removed member
  only once it stood for `settle_s` and a round trip proved the link);
- the daemon's gate: every stop, restart and retry is a `DaemonOrder` that
  `imexd.agent.gate.admit` made, from here (`order`, `shutdown`, the retry in `Apply`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import structlog

from imexd.agent.actions import (
    Action,
    Apply,
    Clear,
    Disown,
    Follow,
    ProbeNow,
    Publish,
    Reconcile,
    RoundStep,
    SaveState,
    SetClientId,
    SetWill,
    StepSoon,
    Subscribe,
    Survey,
    Unsubscribe,
)
from imexd.agent.followed import Followed
from imexd.agent.gate import Cause, DaemonOrder, IdentityKey, Kind, admit, runs_as
from imexd.agent.inputs import (
    BusInput,
    DaemonInput,
    Discovered,
    Input,
    Proven,
    Reconciled,
    Retarget,
    Step,
    Surveyed,
)
from imexd.agent.rounds import Rounds, removes_members
from imexd.bus.events import Event, Synced, WillSpec
from imexd.daemon.state import DaemonState
from imexd.membership.desired import Desired
from imexd.membership.shard import DOMAIN_DELETED, Identity, Plan, ShardView
from imexd.messages import (
    Assignment,
    Deleted,
    HealthReport,
    MemberRecord,
    Presence,
    Received,
    Retry,
)
from imexd.names import client_id
from imexd.nodestate import NodeState
from imexd.settings import Settings
from imexd.topics import Topics


def _cause(plan: Plan) -> str:
    """Why `plan` changes what should run: its step's reason, or the domain's delete."""
    if plan.desired is not None and plan.desired.cleanup:
        return DOMAIN_DELETED
    return plan.decision.reason if plan.decision is not None else ""


class NodeCore:
    """The decisions of one node's agent; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        shard: ShardView,
        started_at: float,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self.settings = settings
        self.node = settings.node.name
        self.topics = Topics(settings.bus.topic_prefix)
        self.shard = shard
        self.log = log
        self.assigned = settings.domain.assigned
        self.static_domain = settings.domain.name or None
        self.assigned_domain: str | None = None
        configured = settings.node.clique
        self.clique: str | None = None if configured == "auto" else configured
        self.driver = ""
        self.saved = NodeState()
        """The node's state as loaded at start: its previous slot."""
        self.state = NodeState()
        """The node's state as last saved."""
        self.started_at = started_at
        """Wall-clock start: an `imexd node retry` request written before it is a leftover."""
        self.retry_last: Retry | None = None
        """The last request taken in. A request is new when it differs from this one, not
        when its `at` is larger: a request dated in the future blocks no later one."""
        self.retry_asked: Retry | None = None
        self.daemon = DaemonInput(DaemonState.STOPPED)
        self.released_until = 0.0
        """`now` until which our slot stays given up (FATAL daemon)."""
        self.stale_own: set[str] = set()
        """Topics of records of this node that a broker serves outside its shard."""
        self.presences = Followed(self.topics, shard)
        """The peers' presences followed, and which a claim waits for."""
        self.view_ready = False
        """Membership stepped on the current synced snapshot (cleared when the link goes):
        only then does `desired` say what the broker says."""
        self.unsupervised: int | None = None
        """The pid of a daemon running our config that this agent does not supervise,
        while it stands aside: reported as it is."""
        self.surveyed_at = -math.inf
        """`now` of the last survey (-inf: none since this agent last claimed)."""
        self.survey_due: float | None = None
        self.desired = Desired()
        self.desired_at = 0.0
        """`now` when `desired` last changed."""
        self.departures: dict[IdentityKey, tuple[str, bool]] = {}
        """Identity a daemon ran as -> (cause, incumbent) of the change that moved
        `desired` off it, as the gate admitted it: what a later stop or restart of that
        daemon is judged by (`order`)."""
        self.rounds = Rounds(settings.domain.settle_s)

    # -- inputs ---------------------------------------------------------------------

    def start(self, saved: NodeState) -> None:
        """The node's state as loaded (its incarnation bumped) at the agent's start."""
        self.saved = self.state = saved
        self.shard.start(saved.incarnation)

    def feed(self, happened: Input, *, now: float, wall: float) -> list[Action]:
        """Take one input in; the actions to carry out, in order."""
        match happened:
            case BusInput(event):
                return self._take(event, now, wall)
            case DaemonInput():
                moved = happened.state is not self.daemon.state
                self.daemon = happened
                return [StepSoon()] if moved else []  # a FATAL daemon's slot is released
            case Discovered(clique, driver, reason):
                if clique != self.clique:
                    self.log.info("fabric.clique", clique=clique, reason=reason)
                self.clique, self.driver = clique, driver
                return [StepSoon()]
            case Surveyed(pid):
                if pid != self.unsupervised:
                    self.log.warning(
                        "daemon.unsupervised",
                        pid=pid,
                        why="this agent stands aside for another agent of this node's name "
                        "and neither adopts nor stops this daemon",
                    )
                self.unsupervised = pid
                return []
            case Proven(mark, ok):
                if ok:
                    self.shard.proven(mark)
                self.rounds.proven(ok, now)
                return []
            case Reconciled(ok, probe_now):
                self.rounds.ended(ok=ok, probe_now=probe_now, now=now)
                return [ProbeNow()] if ok and probe_now else []
            case Retarget():
                return self._retarget(now)
            case Step(channel_count):
                return self._step(now, wall, channel_count)
        raise TypeError(f"not an input: {happened!r}")  # pragma: no cover

    def sort(self, event: Event) -> bool | None:
        """How the driver takes `event` in: None, through the control plane's order and
        `feed`; else at once, True when membership should step on it.

        A health report is followed only so that the bus puts back a copy of ours someone
        else wrote, and to clear our own in a domain we left; a peer's presence is news
        only as an end (it is refreshed with every report); our own, in a snapshot, also
        says which past run spoke last (`ShardView.last_run`)."""
        if isinstance(event, Synced):
            self.presences.synced_filters = event.filters
        ref = getattr(event, "ref", None)
        if ref is not None and ref.kind == "health":
            return self._note_stale_own(event)
        if (
            isinstance(event, Received)
            and isinstance(event.payload, Presence)
            and not event.payload.lost
            and event.payload.stopped is None
            and not (event.retained and event.payload.node == self.node)
        ):
            return False
        return None

    def _take(self, event: Event, now: float, wall: float) -> list[Action]:
        """One bus event into the shard, the assignment and the retry requests."""
        shard = self.shard
        actions = self._identity(shard.apply(event, now), wall)
        if not shard.synced:
            self.view_ready = False
        ref = getattr(event, "ref", None)
        if ref is not None and ref.kind == "assignment" and ref.node == self.node:
            if isinstance(event, Received) and isinstance(event.payload, Assignment):
                self.assigned_domain = event.payload.domain
            elif isinstance(event, Deleted):
                self.assigned_domain = None
        elif (
            isinstance(asked := getattr(event, "payload", None), Retry)
            and asked.state == "asked"
            and asked.at > self.started_at
            and asked != self.retry_last
        ):
            self.retry_last = self.retry_asked = asked  # each request once
            self.log.info("retry.asked", by=asked.by, at=asked.at)
            actions.append(Reconcile())
        self._note_stale_own(event)
        return actions

    def _note_stale_own(self, event: Event) -> bool:
        """Whether `event` is a record of this node that a broker serves outside its shard
        (`ShardView.stale_own`: a standby restored from an older disk): the next step
        clears it."""
        if (
            isinstance(event, Received)
            and isinstance(event.payload, MemberRecord | HealthReport)
            and self.shard.stale_own(event.ref, event.payload)
        ):
            self.stale_own.add(event.topic)
            return True
        return False

    # -- identity on the bus ----------------------------------------------------------

    @property
    def client_id(self) -> str:
        """`imexd-<node>` (a node name that is no valid client id encoded: names.client_id)."""
        return client_id("imexd", self.node)

    def will(self, wall: float) -> WillSpec:
        """Our will, one for the agent's run whatever shard it is in: our presence marked
        lost (`ShardView.will`), so that joining or leaving never connects again."""
        return self.shard.will(self.topics, at=wall)

    # -- target -----------------------------------------------------------------------

    @property
    def wanted_domain(self) -> str | None:
        """The domain this node should be in: static, or as the control plane assigned."""
        return self.assigned_domain if self.assigned else self.static_domain

    def target(self) -> tuple[str, str] | None:
        domain = self.wanted_domain
        if domain is None or self.clique is None:
            return None
        return domain, self.clique

    def shard_filters(self, domain: str, clique: str) -> tuple[str, str]:
        """The bus filters a shard's view is made of: the domain's spec, its members."""
        return self.topics.spec(domain), self.topics.members_filter(domain, clique)

    def _retarget(self, now: float) -> list[Action]:
        """Leave the current shard and join the target one when they differ."""
        actions: list[Action] = [Follow(self.wanted_domain, self.clique)]
        target = self.target()
        shard = self.shard
        if target == shard.current:
            return actions
        topics = self.topics
        if (old := shard.current) is not None:
            domain, clique = old
            self.log.info("membership.leave", domain=domain, clique=clique)
            if shard.leaving():  # no report for the old shard after the clears
                actions.append(self.clear(domain, clique))
            actions.append(
                Unsubscribe(
                    (
                        topics.members_filter(domain, clique),
                        topics.spec(domain),
                        topics.retry(domain, self.node),
                        topics.health(domain, self.node),
                    )
                )
            )
        # Only a snapshot completed after this point, of both filters, covers the shard.
        filters = () if target is None else self.shard_filters(*target)
        if shard.join(target, now, needs=frozenset(filters)):
            actions.append(SetClientId(self.client_id))
        self.view_ready = False
        if target is None:
            # No domain: clean up. A domain but no clique yet (discovery pending or
            # failing): nothing to run and nothing to remove; the node is not ready.
            actions += self._set_desired(Desired(cleanup=self.wanted_domain is None), "", now)
            return actions
        domain, clique = target
        self.log.info("membership.join", domain=domain, clique=clique or "none")
        # The will stays (it is our presence): the new filters' snapshot is all a join
        # waits for. A claim settles at its echo (imexd.membership.slots.barrier): the
        # members filter needs the broker's one order, the spec and the retry request
        # not; our own health report is followed so that the bus puts a copy back.
        spec, members = self.shard_filters(domain, clique)
        own = (topics.retry(domain, self.node), topics.health(domain, self.node))
        actions += [Subscribe((members,)), Subscribe((spec, *own), ordered=False)]
        return actions

    def clear(self, domain: str, clique: str) -> Clear:
        """Clear our member record and health report of the shard (domain, clique)."""
        return Clear(
            (self.topics.member(domain, clique, self.node), self.topics.health(domain, self.node))
        )

    # -- membership -------------------------------------------------------------------

    def next_due(self, now: float) -> float | None:
        """`now` when a membership step is due without any event (None: none is): the
        shard's timers, the release of a FATAL daemon's slot, the survey while standing
        aside."""
        due = [t for t in (self.shard.due_at(now), self.survey_due) if t is not None]
        if (release_at := self._release_at()) is not None and release_at > now:
            due.append(release_at)
        if self.released_until > now:
            due.append(self.released_until)
        return min(due) if due else None

    def _identity(self, identity: Identity | None, wall: float) -> list[Action]:
        """What a change of who we are on the bus takes (from a bus event or a step)."""
        shard = self.shard
        if identity is Identity.BACK:
            return [SetClientId(self.client_id), SetWill(self.will(wall))]
        if identity is not Identity.ASIDE:
            return []
        # Our will would clear the other's record; another client id stops the two from
        # taking the broker session from each other. Its report and presence are the
        # other agent's to write: neither replayed nor put back by us.
        duplicate = client_id("imexd", self.node, "duplicate", str(shard.incarnation))
        actions: list[Action] = [
            SetWill(None),
            SetClientId(duplicate),
            Disown(self.topics.presence(self.node)),
        ]
        if shard.current is not None:
            actions.append(Disown(self.topics.health(shard.current[0], self.node)))
        return actions

    def _step(self, now: float, wall: float, channel_count: int | None) -> list[Action]:
        """One membership step: the shard view derives, and its plan becomes actions."""
        actions: list[Action] = []
        while self.stale_own:
            # Records of this node a broker serves outside its shard (a standby restored
            # from an older disk): we deleted them when we left, so not ours to keep.
            topic = self.stale_own.pop()
            self.log.info("membership.stale_record_cleared", topic=topic)
            actions.append(Publish(topic, None))
        shard = self.shard
        desired = self.desired
        plan = shard.derive(
            now,
            wall_now=wall,
            saved=self.saved,
            running=desired.run and (desired.domain, desired.clique) == shard.current,
            release=lambda: self._release_due(now),
        )
        self.survey_due = None
        actions += self._identity(shard.identity, wall)
        shard.identity = None
        detail = plan.decision.message if plan.decision is not None else ""
        if plan.desired is not None and self._kept(plan.desired, _cause(plan), detail):
            # The plan would stop or move what runs against the gate: nothing of it is
            # published or kept, as for any hold.
            plan = Plan(hold=True, wake_at=plan.wake_at)
        if plan.hold:
            # Another agent may run as this node: what runs keeps running, and a daemon
            # of our config that runs without us is reported as it is, looked for at
            # most once per probe interval, as often as a daemon of ours is probed.
            interval = self.settings.daemon.probe_interval_s
            if now - self.surveyed_at >= interval:
                self.surveyed_at = now
                actions.append(Survey())
            self.survey_due = self.surveyed_at + interval
        elif plan.desired is None:
            return actions  # no shard, or no synced snapshot yet
        elif plan.desired.cleanup:
            actions += self._leave_deleted(plan, now)
        else:
            actions += self._claim(plan, now, wall, channel_count)
        if shard.synced:  # `desired` follows the synced snapshot (unless the link went)
            self.view_ready = True
        return actions

    def _claim(
        self, plan: Plan, now: float, wall: float, channel_count: int | None
    ) -> list[Action]:
        """Publish the claim step of `plan`, keep it, and take what should run."""
        shard = self.shard
        decision = plan.decision
        assert decision is not None  # noqa: S101 - a claim step
        assert plan.desired is not None  # noqa: S101 - a claim step
        actions: list[Action] = []
        self.unsupervised = None
        self.surveyed_at = -math.inf
        if plan.outbid:
            actions += self._save(replace(self.state, incarnation=shard.incarnation))
        if plan.publish and shard.current is not None and not plan.outbid:
            record = shard.record(decision.claim, driver=self.driver, channel_count=channel_count)
            shard.sending(record)  # before the publish: its echo is the claim's barrier
            # Not replayed by the bus on a new link: the shard judges that link's snapshot
            # first (our slot may have been taken meanwhile) and publishes it again itself.
            actions.append(
                Publish(self.topics.member(*shard.current, self.node), record, replay=False)
            )
            shard.sent(record)  # handed to the bus: ours to clear from here on
        shard.commit(plan)
        if plan.outbid:
            # Only a will of the raised incarnation ends a record of it: that record goes
            # out on the next link, whose CONNECT carries that will (`republish`), never on
            # this one, whose will a clean DISCONNECT drops.
            actions.append(SetWill(self.will(wall)))
        if decision.settled and decision.claim.slot is not None and shard.current is not None:
            domain, clique = shard.current
            state = NodeState(
                domain=domain,
                clique=clique,
                slot=decision.claim.slot,
                incarnation=shard.incarnation,
            )
            actions += self._save(state)
        actions += self._set_desired(plan.desired, decision.reason, now)
        return actions

    def _leave_deleted(self, plan: Plan, now: float) -> list[Action]:
        """The control plane deletes the domain: clear our record and stop the daemon."""
        assert plan.desired is not None  # noqa: S101 - a leave step
        # Cleanup first: it stops the reports, so none follows the clears.
        actions = self._set_desired(plan.desired, DOMAIN_DELETED, now)
        shard = self.shard
        if plan.leave and shard.current is not None:
            domain, clique = shard.current
            self.log.info("membership.domain_deleted", domain=domain)
            if shard.published:
                shard.sending(None)  # the clear's echo is ours, not a record written over
                actions.append(self.clear(domain, clique))
            shard.left()
        return actions

    def _save(self, state: NodeState) -> list[Action]:
        if state == self.state:
            return []
        self.state = state
        return [SaveState(state)]

    def _release_due(self, now: float) -> bool:
        """Whether to give our slot up: the daemon has been FATAL for release_after_s.

        Latched for claim_stale_s once it fires, so that a waiting node can claim the slot
        before we would take it back.
        """
        release_at = self._release_at()
        if release_at is not None and now >= release_at:
            if now >= self.released_until:
                self.log.warning(
                    "membership.release",
                    slot=self.shard.claim.slot,
                    fatal_for_s=round(self.settings.daemon.release_after_s, 1),
                )
            self.released_until = now + self.settings.domain.claim_stale_s
        return now < self.released_until

    def _release_at(self) -> float | None:
        """`now` from which a FATAL daemon's slot is given up: release_after_s after it
        turned FATAL (None: it is not FATAL, or the release is off)."""
        after = self.settings.daemon.release_after_s
        daemon = self.daemon
        if after <= 0 or daemon.state is not DaemonState.FATAL or daemon.fatal_since is None:
            return None
        return daemon.fatal_since + after

    # -- what should run, and the gate --------------------------------------------------

    def _set_desired(self, desired: Desired, cause: str, now: float) -> list[Action]:
        """Take `desired` as what should run, if the gate admits what it does to the
        daemon that runs now; `cause`: why it changed (a `membership.Reason`, ...)."""
        old = self.desired
        if desired == old or self._kept(desired, cause):
            return []
        if (running := runs_as(old)) is not None and runs_as(desired) != running:
            self.departures[running] = (self._moved_by(cause), self.shard.incumbent)
        if (ident := runs_as(desired)) is not None:
            self.departures.pop(ident, None)
        self.desired = desired
        self.desired_at = now
        return [Reconcile()]

    def _moved_by(self, cause: str) -> str:
        """The cause of a change that moves `desired` off what runs: the node's own when
        its target moved (`Cause.LEFT_SHARD`), else `cause`."""
        old = self.desired
        return Cause.LEFT_SHARD if (old.domain, old.clique) != self.shard.current else cause

    def _kept(self, desired: Desired, cause: str, detail: str = "") -> bool:
        """Whether the gate refuses what `desired` does to the daemon that runs now (a stop
        or a move for another node's record while ours stood without a break): then the
        daemon keeps running, and the broken promise of the slot rules is logged."""
        old = self.desired
        running = runs_as(old)
        if running is None or runs_as(desired) == running:
            return False
        cause = self._moved_by(cause)
        why = "left" if desired.cleanup else "not a settled member"
        incumbent = self.shard.incumbent
        if admit("stop", why, cause, running=old, desired=desired, incumbent=incumbent):
            return False
        self.log.error(
            "membership.daemon_kept",
            slot=old.slot,
            cause=cause,
            detail=detail,
            why="another node's record would stop or move the daemon of a member whose "
            "record stood without a break",
        )
        return True

    def order(
        self, kind: Kind, why: str, running: IdentityKey | None, desired: Desired
    ) -> DaemonOrder | None:
        """The gate's order for the reconciler to `kind` a daemon started as `running`
        (None: none of ours runs) while `desired` should run; None: keep it running."""
        if running is None:
            return admit(kind, why, "", running=Desired(), desired=desired, incumbent=False)
        domain, clique, slot = running
        runs = Desired(domain=domain, clique=clique, slot=slot, run=True)
        if runs_as(desired) == running:
            return admit(
                kind, why, Cause.SAME_IDENTITY, running=runs, desired=desired, incumbent=True
            )
        cause, incumbent = self.departures.get(running, ("", self.shard.incumbent))
        return admit(kind, why, cause, running=runs, desired=desired, incumbent=incumbent)

    def leave(self, wall: float) -> list[Action]:
        """What the agent publishes when it leaves (SIGTERM), before the daemon stops."""
        shard, actions = self.shard, list[Action]()
        if not shard.duplicate:  # else our topics may be another agent's
            # Our presence's last word: this agent stopped, so that the control plane
            # refuses the node at once (AgentDown) instead of counting it seen.
            presence = shard.presence(None, at=wall, stopped=wall)
            actions.append(Publish(self.topics.presence(self.node), presence))
        if shard.current is not None and (
            shard.published or (shard.past_stands and not shard.duplicate)
        ):
            # Only records this agent or a past run of it wrote (a past run's, ended by its
            # will or not, would stand for ever: a later run overwrites the presence that
            # ends it); a duplicate never clears the other's.
            actions.append(self.clear(*shard.current))
        return actions

    def shutdown(self) -> DaemonOrder:
        """The order that stops the daemon when the agent leaves (SIGTERM)."""
        order = admit(
            "stop",
            "the agent is leaving",
            Cause.LEAVE,
            running=self.desired,
            desired=Desired(),
            incumbent=True,
        )
        assert order is not None  # noqa: S101 - a leave is always the node's own
        return order

    # -- reconcile rounds -------------------------------------------------------------

    def reconcile_next(self, now: float, applied: Mapping[int, str] | None) -> RoundStep:
        """What the reconcile round in progress does next (`Apply` ends it), paced by
        `Rounds`; `applied`: slot -> address the daemon was last given (None: none)."""
        shard = self.shard
        wait = self.rounds.next(
            now,
            removes=removes_members(self.desired, applied),
            changed_at=self.desired_at,
            unproven=bool(shard.unproven),
            mark=shard.proof_mark,
            view_ready=shard.current is None or self.view_ready,
        )
        if wait is not None:
            return wait
        retry = None
        if (asked := self.retry_asked) is not None:
            self.retry_asked = None
            why = f"imexd node retry by {asked.by or 'an operator'}"
            runs = self.desired
            retry = admit("retry", why, Cause.RETRY, running=runs, desired=runs, incumbent=True)
            self.released_until = 0.0  # claim again a slot that a FATAL daemon gave up
        return Apply(self.desired, self.saved, retry)
