"""Containment, in process: no bug in one of the agent's tasks stops or restarts IMEX.

The middle tier between the pure tests and the scenarios: one `Agent` runs as a
coroutine of the test, against a real Mosquitto and the simulated daemon, and the test
breaks one piece of it from inside (a renderer that raises, a loop that keeps failing,
a ctl that hangs) and watches the facts: the daemon's pid, the agent's exit code, its
heartbeats and its metrics. The last tests drive only the public root coroutine,
`agent.run(settings, stop=..., handover=...)`, as the CLI does: events in (the two
events the signals set), facts out (its health endpoint and its exit code).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from imexd.agent import reconcile, report
from imexd.agent import run as agent_module
from imexd.agent.actions import Action
from imexd.agent.core import NodeCore
from imexd.agent.probes import PROBE_SERIES_S, DaemonProbes
from imexd.agent.run import EXIT_HANDOVER, Agent
from imexd.daemon.ctl import DomainResult, LocalProbe, Prober
from imexd.daemon.state import DaemonState, DaemonStatus
from imexd.health import guard
from imexd.health.conditions import Heartbeats
from imexd.health.metrics import Metrics
from imexd.logs import get_logger
from imexd.membership.desired import Desired
from imexd.settings import settings_from_mapping
from tests.brokers import Mosquitto
from tests.cluster import Node, end_in_process
from tests.support import until

WAIT_S = 30.0


@dataclass
class Running:
    agent: Agent
    stop: asyncio.Event
    handover: asyncio.Event
    task: asyncio.Task[int]


@asynccontextmanager
async def running_agent(tmp_path: Path) -> AsyncIterator[Running]:
    """A ready one-node domain: an in-process agent with a simulated daemon."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    node = Node(tmp_path, "n1", [broker.url], domain="d1", clique="c1")
    settings = settings_from_mapping(node.sections, environ={})
    agent = Agent(settings)
    stop, handover = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(agent.run(stop=stop, handover=handover))
    try:
        await until(lambda: agent.health.is_ready or task.done())
        assert not task.done(), "the agent ended before it was ready"
        yield Running(agent, stop, handover, task)
    finally:
        await end_in_process([node], [(stop, task)], WAIT_S)
        broker.stop()


def daemon_pid(agent: Agent) -> int | None:
    assert agent.supervisor is not None
    return agent.supervisor.pid


def task_failures(agent: Agent, task: str) -> float:
    text = agent.metrics.render().decode()
    line = f'imexd_task_failures_total{{task="{task}"}} '
    values = [float(row.split()[-1]) for row in text.splitlines() if row.startswith(line)]
    return values[0] if values else 0.0


async def test_each_tasks_failure_counter_is_shown_from_zero() -> None:
    """imexd_task_failures_total has a series at 0 for every task the guard started, so
    a panel or alert on a healthy agent reads 0, not "No data"."""
    metrics = Metrics()
    guarded = guard.Guard(Heartbeats(), metrics, get_logger("test"))

    async def done() -> None:
        return None

    async with asyncio.timeout(10), asyncio.TaskGroup() as tasks:
        guarded.start(tasks, "reconcile", done)
        guarded.start(tasks, "probe", done)
    text = metrics.render().decode()
    assert 'imexd_task_failures_total{task="reconcile"} 0.0' in text
    assert 'imexd_task_failures_total{task="probe"} 0.0' in text


async def test_a_rest_ends_at_its_event_or_its_deadline_and_owes_no_beat() -> None:
    """`Guard.rest`: True when woken, False at the deadline, never stale meanwhile."""
    clock = [100.0]
    hb = Heartbeats(clock=lambda: clock[0])
    guarded = guard.Guard(hb, Metrics(), get_logger("test"))
    hb.register("probe", guard.BEAT_S)
    wake = asyncio.Event()
    async with asyncio.timeout(10):
        resting = asyncio.create_task(guarded.rest("probe", wake, None))
        await asyncio.sleep(0.05)
        clock[0] += 60.0
        assert hb.stale() == []
        wake.set()
        assert await resting
        assert hb.stale() == []
        wake.clear()
        assert not await guarded.rest("probe", wake, time.monotonic() + 0.05)
        assert not await guarded.rest("probe", None, time.monotonic() - 1.0)  # past: at once


async def test_work_beats_its_heartbeat_until_its_bound_and_ends_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`Guard.beating`: work's result or error comes back; it beats every BEAT_S while
    it runs, not after `limit` + the margin, and not after the work ended."""
    monkeypatch.setattr(guard, "BEAT_S", 0.02)
    monkeypatch.setattr(guard, "WORK_MARGIN_S", 0.0)
    hb = Heartbeats()
    guarded = guard.Guard(hb, Metrics(), get_logger("test"))
    hb.register("probe", 1.0)
    beats: list[float] = []
    beat = hb.beat

    def counted(name: str) -> None:
        beats.append(time.monotonic())
        beat(name)

    hb.beat = counted  # type: ignore[method-assign]

    async def answer() -> int:
        return 42

    async def fails() -> None:
        raise ValueError("broken")

    async with asyncio.timeout(10):
        assert await guarded.beating("probe", answer(), limit=1.0) == 42
        with pytest.raises(ValueError, match="broken"):
            await guarded.beating("probe", fails(), limit=1.0)
        await asyncio.sleep(0.1)
        assert beats == []  # work done at once: no beat, no timer left behind
        start = time.monotonic()
        await guarded.beating("probe", asyncio.sleep(0.4), limit=0.2)
        assert 3 <= len(beats) <= 12
        assert all(t - start < 0.2 + 0.05 for t in beats), "beats past the bound"
        beats.clear()
        await asyncio.sleep(0.1)
        assert beats == []


async def test_cancelling_a_beating_task_cancels_its_work() -> None:
    """A task cancelled while `Guard.beating` awaits its work: the work is cancelled and
    the task ends cancelled."""
    guarded = guard.Guard(Heartbeats(), Metrics(), get_logger("test"))
    guarded.heartbeats.register("probe", 1.0)
    started, ended = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    async with asyncio.timeout(10):
        task = asyncio.create_task(guarded.beating("probe", work(), limit=1.0))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended.is_set()


async def test_an_idle_agents_tasks_are_not_woken_to_beat(tmp_path: Path) -> None:
    """A ready agent with nothing to do: its tasks wait for their input or their own
    deadlines; no timer wakes them every second to beat."""
    async with running_agent(tmp_path) as r:
        await asyncio.sleep(1.0)  # the start's last turns
        beats: list[str] = []
        beat = r.agent.heartbeats.beat

        def counted(name: str) -> None:
            beats.append(name)
            beat(name)

        r.agent.heartbeats.beat = counted  # type: ignore[method-assign]
        await asyncio.sleep(3.0)
        resting = {"events", "membership", "reconcile", "rebuild", "channels", "watchdog"}
        woken = [name for name in beats if name in resting]
        assert len(woken) <= 2, f"{woken}: a task at rest beat while nothing happened"
        assert r.agent.heartbeats.stale() == []


async def test_a_renderer_that_raises_never_touches_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected error in reconcile is logged with its traceback and retried; IMEX runs on."""
    async with running_agent(tmp_path) as r:
        pid = daemon_pid(r.agent)
        calls = 0

        def broken(*_args: Any, **_kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            raise RuntimeError("a bug in the renderer")

        monkeypatch.setattr(reconcile, "render_files", broken)
        with capture_logs() as logs:
            r.agent.dirty.set()
            await until(lambda: calls >= 2)  # retried with backoff, not given up
        failed = [e for e in logs if e["event"] == "reconcile.failed"]
        assert failed
        assert "a bug in the renderer" in failed[0]["error"]
        assert isinstance(failed[0]["exc_info"], RuntimeError)
        assert not r.task.done()
        assert daemon_pid(r.agent) == pid
        assert "reconcile failed" in r.agent.facts().daemon.write_error
        monkeypatch.undo()
        await until(lambda: r.agent.facts().daemon.write_error == "")
        assert daemon_pid(r.agent) == pid


async def test_a_failing_task_is_restarted_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop that raises is restarted with backoff, counted, and the others go on."""
    monkeypatch.setattr(guard, "TASK_RESTART_INITIAL_S", 0.05)
    async with running_agent(tmp_path) as r:
        pid = daemon_pid(r.agent)
        original = r.agent.probes._local
        fail = {"left": 3}

        async def flaky() -> None:
            if fail["left"] > 0:
                fail["left"] -= 1
                raise ValueError("probe bug")
            await original()

        monkeypatch.setattr(r.agent.probes, "_local", flaky)
        with capture_logs() as logs:
            r.agent.probes.now()
            await until(lambda: fail["left"] == 0 and task_failures(r.agent, "probe") >= 3)
        events = [e for e in logs if e["event"] == "agent.task_failed"]
        assert [e["task"] for e in events] == ["probe"] * 3
        assert all(isinstance(e["exc_info"], ValueError) for e in events)
        assert not r.task.done()
        assert daemon_pid(r.agent) == pid
        assert r.agent.heartbeats.stale() == []
        assert r.agent.health.is_ready


async def test_a_task_that_keeps_failing_ends_the_agent_as_a_hand_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too many failures exit 75 with the daemon running and the record kept."""
    monkeypatch.setattr(guard, "TASK_RESTART_INITIAL_S", 0.01)
    monkeypatch.setattr(guard, "TASK_RESTART_MAX_S", 0.05)
    monkeypatch.setattr(guard, "TASK_FAILURES_TO_EXIT", 4)
    async with running_agent(tmp_path) as r:
        pid = daemon_pid(r.agent)
        assert pid is not None

        async def always(_bus: object, _report: object) -> None:
            raise KeyError("report bug")

        monkeypatch.setattr(r.agent.reporter, "publish", always)
        r.agent.changed.set()
        code = await asyncio.wait_for(asyncio.shield(r.task), WAIT_S)
        assert code == EXIT_HANDOVER
        os.kill(pid, 0)  # the daemon still runs, for the next agent to adopt
        assert r.agent.shard.published  # and our record was not cleared


async def test_a_hung_ctl_does_not_fail_healthz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ctl that hangs for longer than three beats keeps the probe task's heartbeat fresh."""
    async with running_agent(tmp_path) as r:
        hung = asyncio.Event()

        async def hang() -> None:
            hung.set()
            await asyncio.sleep(6.0)  # > 3 x BEAT_S; below probe_timeout_s + the margin

        monkeypatch.setattr(r.agent.probes, "_local", hang)
        r.agent.probes.now()
        await asyncio.wait_for(hung.wait(), WAIT_S)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            assert r.agent.heartbeats.stale() == []
            await asyncio.sleep(0.25)


@asynccontextmanager
async def public_run(tmp_path: Path) -> AsyncIterator[tuple[Node, Running]]:
    """`agent.run` of a one-node domain, ready, with nothing but its events to drive it."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    node = Node(tmp_path, "n1", [broker.url], domain="d1", clique="c1")
    settings = settings_from_mapping(node.sections, environ={})
    stop, handover = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(agent_module.run(settings, stop=stop, handover=handover))
    try:
        # The agent answers HTTP on this loop: ask it from a thread.
        deadline = time.monotonic() + WAIT_S
        while not task.done() and not await asyncio.to_thread(node.ready):
            assert time.monotonic() < deadline, "the agent never became ready"
            await asyncio.sleep(0.05)
        assert not task.done(), "the agent ended before it was ready"
        yield node, Running(Agent(settings), stop, handover, task)
    finally:
        await end_in_process([node], [(stop, task)], WAIT_S)
        broker.stop()


async def test_run_leaves_cleanly_on_stop(tmp_path: Path) -> None:
    """`stop` alone: exit 0, the daemon stopped, the health endpoint gone."""
    async with public_run(tmp_path) as (node, r):
        pid = await asyncio.to_thread(node.daemon_pid)
        assert pid is not None
        r.stop.set()
        assert await asyncio.wait_for(asyncio.shield(r.task), WAIT_S) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert node.get("/healthz") == (0, None)


async def test_run_hands_over_on_handover(tmp_path: Path) -> None:
    """`handover` then `stop`: exit 75 with the daemon still running for the next agent."""
    async with public_run(tmp_path) as (node, r):
        pid = await asyncio.to_thread(node.daemon_pid)
        assert pid is not None
        r.handover.set()
        r.stop.set()
        assert await asyncio.wait_for(asyncio.shield(r.task), WAIT_S) == EXIT_HANDOVER
        os.kill(pid, 0)  # still running


# ---------------------------------------------------------------------------------
# No fixed waits: one connect, ready on READY, a domain probe after the change

SLOW_TIMERS = {
    # Large on purpose: anything reached before them came from a fact, not a timer.
    "daemon": {"start_s": 30.0, "probe_interval_s": 30.0, "domain_probe_interval_s": 600.0}
}


def start_agent(node: Node) -> Running:
    agent = Agent(settings_from_mapping(node.sections, environ={}))
    stop, handover = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(agent.run(stop=stop, handover=handover))
    return Running(agent, stop, handover, task)


async def end_agents(nodes: list[Node], runs: list[Running]) -> None:
    await end_in_process(nodes, [(r.stop, r.task) for r in runs], WAIT_S)


SLOW_READY: dict[str, dict[str, Any]] = {
    "daemon": {"start_s": 0.3, "probe_interval_s": 30.0, "domain_probe_interval_s": 600.0},
    "imex": {"env": {"IMEXD_SIM_START_DELAY_S": "1.5"}},
}
"""A daemon that says READY 1.5 s after its start, long after `start_s` (0.3 s); probes
that only an event can bring sooner than 30 s and 600 s."""


@asynccontextmanager
async def one_agent(tmp_path: Path, overrides: dict[str, dict[str, Any]]) -> AsyncIterator[Running]:
    """One agent of a one-node domain on its own broker, started; stopped at the end."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    node = Node(tmp_path, "n1", [broker.url], domain="d1", clique="c1", overrides=overrides)
    runs: list[Running] = []
    try:
        runs.append(run := start_agent(node))
        yield run
    finally:
        await end_agents([node], runs)
        broker.stop()


async def test_the_domain_is_probed_every_domain_probe_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ctl -N -j` runs every domain_probe_interval_s on its own timer, not when the local
    probe's (30 s here) happens to wake the probe task."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    timers = {"start_s": 30.0, "probe_interval_s": 30.0, "domain_probe_interval_s": 0.5}
    node = Node(
        tmp_path, "n1", [broker.url], domain="d1", clique="c1", overrides={"daemon": timers}
    )
    probed: list[float] = []
    domain = Prober.domain

    async def counted(self: Prober, **kwargs: Any) -> DomainResult:
        probed.append(time.monotonic())
        return await domain(self, **kwargs)

    monkeypatch.setattr(Prober, "domain", counted)
    runs: list[Running] = []
    try:
        runs.append(r := start_agent(node))
        await until(lambda: r.agent.health.is_ready or r.task.done())
        assert not r.task.done()
        await asyncio.sleep(1.0)  # the start's series is over: what follows is the timer
        del probed[:]
        await asyncio.sleep(3.0)
        assert len(probed) >= 4, probed
    finally:
        await end_agents([node], runs)
        broker.stop()


async def test_a_configured_domain_connects_once_and_is_ready_on_ready(tmp_path: Path) -> None:
    """The will (the node's presence) rides on the first CONNECT, and READY (not start_s)
    makes the daemon RUNNING."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    node = Node(tmp_path, "n1", [broker.url], domain="d1", clique="c1", overrides=SLOW_TIMERS)
    runs: list[Running] = []
    try:
        with capture_logs() as logs:
            started = time.monotonic()
            runs.append(r := start_agent(node))
            await until(lambda: r.agent.health.is_ready or r.task.done())
            assert not r.task.done()
            assert r.agent.supervisor is not None
            # Checked while start_s (30 s) has not elapsed: READY made it RUNNING.
            assert time.monotonic() - started < 30.0
            assert r.agent.supervisor.state is DaemonState.RUNNING
        connects = [e for e in logs if e["event"] == "bus_connected"]
        assert len(connects) == 1, connects
        assert connects[0]["will"] == "imex/v2/nodes/n1/presence"
        assert not [e for e in logs if e["event"] == "bus_disconnected"]
    finally:
        await end_agents([node], runs)
        broker.stop()


async def test_a_join_is_probed_after_the_signal_not_after_the_interval(tmp_path: Path) -> None:
    """With domain probes 600 s apart, both members see each other connected after a join."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    nodes = [
        Node(tmp_path, name, [broker.url], domain="d1", clique="c1", overrides=SLOW_TIMERS)
        for name in ("n1", "n2")
    ]
    runs: list[Running] = []
    try:
        runs.append(first := start_agent(nodes[0]))
        await until(lambda: first.agent.health.is_ready or first.task.done())
        assert first.agent.supervisor is not None
        reloads = first.agent.supervisor.reloads_sent
        runs.append(second := start_agent(nodes[1]))

        def sees_both(r: Running) -> bool:
            view = r.agent.probes.domain_view
            return (
                view is not None
                and len(view.slots) == 2
                and all(link.connected for link in view.slots.values())
            )

        await until(lambda: sees_both(first) and sees_both(second))
        assert first.agent.supervisor.reloads_sent > reloads  # the join was signalled
        assert not first.task.done()
        assert not second.task.done()
    finally:
        await end_agents(nodes, runs)
        broker.stop()


async def test_the_daemons_ready_line_is_probed_at_once_not_at_the_interval(
    tmp_path: Path,
) -> None:
    """Issue 22: a daemon slower to say READY than `start_s` was counted RUNNING by time,
    which ended the quick `ctl -q` series, so its READY waited for `probe_interval_s`
    (here 30 s). Its own lines are news now: the node is ready within seconds of them."""
    async with one_agent(tmp_path, SLOW_READY) as run:
        await until(lambda: run.agent.supervisor is not None and run.agent.supervisor.pid)
        supervisor = run.agent.supervisor
        assert supervisor is not None
        await until(lambda: supervisor.state is DaemonState.RUNNING, within=10)
        assert run.agent.probes.imex_status != "READY", "counted RUNNING by time, not READY"
        await until(lambda: run.agent.health.is_ready or run.task.done(), within=15)
        assert run.agent.probes.imex_status == "READY"
        assert not run.task.done()


async def test_the_daemons_ready_is_judged_at_once_not_at_the_end_of_a_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22, seen as `bench/startup.py`'s READY line -> ready report growing from 24 to
    56 ms: any change judged within `REPORT_PACE_S` before the daemon's READY (there, a
    periodic domain probe) held READY's judgement to the end of that pause. The daemon's
    and its probes' news is never paced now. With a 20 s pause, readiness before the fix
    waited for the end of the pause that the start's own changes began."""
    monkeypatch.setattr(report, "REPORT_PACE_S", 20.0)
    async with one_agent(tmp_path, SLOW_READY) as run:
        await until(lambda: run.agent.probes.imex_status == "READY" or run.task.done(), within=15)
        said = time.monotonic()
        await until(lambda: run.agent.health.is_ready or run.task.done(), within=10)
        assert not run.task.done()
        assert time.monotonic() - said < 10


def test_the_probes_and_the_keepers_news_is_urgent(tmp_path: Path) -> None:
    """What the daemon's probes and the channel keeper report is judged at once (a bus
    event only sets `changed`: a formation brings dozens, judged paced)."""
    node = Node(tmp_path, "n1", ["mqtt://127.0.0.1:1"], domain="d1", clique="c1")
    agent = Agent(settings_from_mapping(node.sections, environ={}))
    agent.probes.on_change()
    assert agent.urgent.is_set()
    assert agent.changed.is_set()
    agent.urgent.clear()
    agent.changed.clear()
    agent.channels.on_change()
    assert agent.urgent.is_set()


async def test_no_domain_probe_asks_a_daemon_that_has_not_said_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22: a daemon counted RUNNING by `start_s` (0.3 s) began the quick series of
    `ctl -N -j` (0.2, 0.5, 1 s ...) while it was still INITIALIZING (1.5 s here): probes
    of links it cannot have yet, one process each, on every node of a job start. The
    series begins at its READY now; then the links are probed until complete."""
    probed: list[tuple[float, str]] = []
    domain = Prober.domain
    agents: list[Agent] = []

    async def counted(self: Prober, **kwargs: Any) -> DomainResult:
        probed.append((time.monotonic(), agents[0].probes.imex_status))
        return await domain(self, **kwargs)

    monkeypatch.setattr(Prober, "domain", counted)
    async with one_agent(tmp_path, SLOW_READY) as run:
        agents.append(run.agent)
        await until(lambda: run.agent.health.is_ready or run.task.done(), within=15)
        assert not run.task.done()
        await until(lambda: run.agent.probes.domain_view is not None, within=5)
        before_ready = [at for at, status in probed if status != "READY"]
        assert before_ready == [], f"{len(before_ready)} domain probes before READY"
        assert probed, "no domain probe after READY"


async def test_a_start_is_not_probed_the_instant_it_is_spawned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22: a new start asked `ctl -q` the instant the daemon was spawned, when no
    process serves a command yet: one refused `ctl` per node in every job start. Its first
    probe now comes with its first lines, or the probe series' first time after the start
    (`PROBE_SERIES_S`; none at all when its READY line came first)."""
    starts: list[float] = []
    probes: list[float] = []
    lines: list[float] = []
    changed = DaemonProbes.on_daemon_change
    heard = DaemonProbes.on_output
    local = Prober.local

    def listened(self: DaemonProbes, ready: bool) -> None:
        lines.append(time.monotonic())
        heard(self, ready)

    def noted(self: DaemonProbes, status: DaemonStatus, seen: tuple[DaemonState, int]) -> None:
        if status.state is DaemonState.STARTING and seen[0] is not DaemonState.STARTING:
            starts.append(time.monotonic())
        changed(self, status, seen)

    async def counted(self: Prober, *, timeout: float | None = None) -> LocalProbe:  # noqa: ASYNC109
        probes.append(time.monotonic())
        return await local(self, timeout=timeout)

    monkeypatch.setattr(DaemonProbes, "on_daemon_change", noted)
    monkeypatch.setattr(DaemonProbes, "on_output", listened)
    monkeypatch.setattr(Prober, "local", counted)
    async with one_agent(tmp_path, SLOW_TIMERS) as run:
        await until(lambda: run.agent.health.is_ready or run.task.done(), within=15)
        assert not run.task.done()
        assert len(starts) == 1, starts
        first = min([at for at in probes if at >= starts[0]], default=math.inf)
        news = min([at for at in lines if at >= starts[0]] + [starts[0] + PROBE_SERIES_S[0]])
        assert first >= news, (
            f"ctl -q {first - starts[0]:.3f} s after the spawn, before its first lines "
            f"({news - starts[0]:.3f} s) and before the probe series' first time"
        )


async def test_the_probe_that_says_ready_is_not_asked_again_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `ctl -q` that says READY made the daemon RUNNING, and that RUNNING asked `ctl
    -q` once more at once, for the answer just read (one more ctl process per node in
    every job start). Whatever said READY (its line or `ctl -q`), the next `ctl -q` now
    waits for `probe_interval_s` (30 s here)."""
    calls: list[float] = []
    local = Prober.local

    async def counted(self: Prober, *, timeout: float | None = None) -> LocalProbe:  # noqa: ASYNC109
        calls.append(time.monotonic())
        return await local(self, timeout=timeout)

    monkeypatch.setattr(Prober, "local", counted)
    async with one_agent(tmp_path, SLOW_TIMERS) as run:
        await until(lambda: run.agent.health.is_ready or run.task.done(), within=15)
        assert not run.task.done()
        assert run.agent.supervisor is not None
        assert run.agent.supervisor.state is DaemonState.RUNNING  # by READY: start_s is 30 s
        ready = time.monotonic()
        await asyncio.sleep(1.5)
        after = [at - ready for at in calls if at > ready]
        assert after == [], f"ctl -q again {after} s after the node was ready"


async def test_a_join_that_changed_nothing_does_not_hold_the_first_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A join is applied at once, and with no member yet it changes nothing (no file, no
    daemon); its settle_s then held the domain's first start, which came a moment later,
    on every job start. settle_s coalesces what a running daemon is given: an apply that
    gave it nothing starts no window."""
    settle_s = 3.0  # large: a start inside it did not wait for it
    marks: dict[str, float] = {}
    apply = reconcile.Reconciler.apply

    async def mark_apply(
        self: reconcile.Reconciler, desired: Desired, saved: Any
    ) -> reconcile.Probe | None:
        key = "start" if desired.members else "join"
        marks.setdefault(key, time.monotonic())
        return await apply(self, desired, saved)

    monkeypatch.setattr(reconcile.Reconciler, "apply", mark_apply)
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    overrides = {"domain": {"settle_s": settle_s, "claim_stale_s": 60.0}}
    node = Node(tmp_path, "n1", [broker.url], domain="d1", clique="c1", overrides=overrides)
    runs: list[Running] = []
    try:
        runs.append(run := start_agent(node))
        await until(lambda: "start" in marks or run.task.done())
        assert not run.task.done()
        # Checked while settle_s (3 s) after the join's apply has not elapsed.
        assert marks["start"] - marks["join"] < settle_s / 2, marks
    finally:
        await end_agents([node], runs)
        broker.stop()


async def test_the_first_change_after_a_quiet_period_is_applied_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reconcile on the leading edge: a member joining a quiet node is applied at once."""
    settle_s = 5.0  # large: an apply inside it did not wait for it
    marks: dict[str, float] = {}
    set_desired, apply = NodeCore._set_desired, reconcile.Reconciler.apply

    def mark_desired(self: NodeCore, desired: Desired, cause: str, now: float) -> list[Action]:
        if self.node == "n1" and len(desired.members) == 2 and desired != self.desired:
            marks.setdefault("desired", time.monotonic())
        return set_desired(self, desired, cause, now)

    async def mark_apply(
        self: reconcile.Reconciler, desired: Desired, saved: Any
    ) -> reconcile.Probe | None:
        if self.settings.node.name == "n1" and len(desired.members) == 2:
            marks.setdefault("apply", time.monotonic())
        return await apply(self, desired, saved)

    monkeypatch.setattr(NodeCore, "_set_desired", mark_desired)
    monkeypatch.setattr(reconcile.Reconciler, "apply", mark_apply)
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    overrides = {"domain": {"settle_s": settle_s, "claim_stale_s": 60.0}}
    nodes = [
        Node(tmp_path, name, [broker.url], domain="d1", clique="c1", overrides=overrides)
        for name in ("n1", "n2")
    ]
    runs: list[Running] = []
    try:
        runs.append(first := start_agent(nodes[0]))
        await until(lambda: first.agent.health.is_ready or first.task.done())
        runs.append(start_agent(nodes[1]))
        await until(lambda: "apply" in marks or first.task.done())
        assert not first.task.done()
        # Checked while settle_s (5 s) after the change has not elapsed.
        assert marks["apply"] - marks["desired"] < settle_s
    finally:
        await end_agents(nodes, runs)
        broker.stop()
