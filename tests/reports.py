"""HealthReports and MemberRecords built with the real health model, as agents write them.

Shared by the pure judgement tests (test_fleet.py) and the control plane's component
tests (test_control.py), so that both judge what a real agent would publish.
"""

from __future__ import annotations

from collections.abc import Mapping

from imexd import facts as fx
from imexd.health import conditions as hl
from imexd.messages import DomainSpec, HealthReport, MemberRecord, MemberState

NOW = 1_800_000_000.0
INTERVAL = 2.0


def member_record(
    node: str, slot: int | None, *, domain: str = "d1", clique: str = "c1", driver: str = ""
) -> MemberRecord:
    return MemberRecord(
        node=node,
        domain=domain,
        clique=clique,
        address=f"127.0.0.{(slot or 0) + 10}",
        slot=slot,
        incarnation=1,
        state=MemberState.MEMBER,
        max_nodes=8,
        mode="names",
        driver=driver,
    )


def report(
    node: str,
    slot: int,
    members: Mapping[int, str],
    *,
    at: float = NOW,
    domain: str = "d1",
    clique: str = "c1",
    daemon: fx.DaemonFacts | None = None,
    down: tuple[str, ...] = (),
    skew: tuple[str, ...] = (),
    probed: bool = True,
    membership: fx.MembershipState = "member",
    driver: str = "",
    since: float | None = None,
) -> HealthReport:
    """A HealthReport as an agent builds it: `down` are members its probe sees not READY."""
    daemon = daemon or fx.DaemonFacts(state="RUNNING", pid=100 + slot, imex_status="READY")
    running = daemon.state == "RUNNING"
    probe = None
    if probed and running:
        probe = fx.LinkFacts(
            slots={
                s: fx.SlotLink(
                    n, "UNAVAILABLE" if n in down else "READY", n not in down and not down
                )
                for s, n in members.items()
            },
            unreachable=tuple(sorted(down)),
            version_mismatch=skew,
        )
    facts = fx.Facts(
        node=node,
        domain=domain,
        clique=clique,
        address=f"127.0.0.{slot + 10}",
        slot=slot,
        incarnation=1,
        driver=driver,
        bus=fx.BusFacts(connected=True, synced=True, broker="mqtt://127.0.0.1:1883"),
        membership=fx.MembershipFacts(
            state=membership,
            max_nodes=8,
            members={s: fx.Member(n, f"127.0.0.{s + 10}") for s, n in members.items()},
        ),
        daemon=daemon,
        domain_probe=probe,
        channels=fx.ChannelFacts(synced=True, count=8, major=242),
    )
    return hl.report(facts, hl.conditions(facts, [], at if since is None else since), at)


THREE = {0: "n1", 1: "n2", 2: "n3"}
SPEC = DomainSpec(domain="d1", nodes=["n1", "n2", "n3"], max_nodes=8, generation=1)
CRASH = fx.DaemonFacts(
    state="FATAL",
    restarts=3,
    last_exit="signal SIGKILL",
    reason="DaemonCrashLoop",
    message="signal SIGKILL: 3 failed starts in 30 s",
)
