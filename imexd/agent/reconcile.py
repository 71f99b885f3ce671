"""Reconcile: what should run (`Desired`) made real in the IMEX files and the daemon.

The node's core decides; this module writes config.cfg, nodes_config.cfg and the hosts
block, and asks the supervisor for exactly what the change needs: start (adopting a
daemon the files still fit), SIGUSR1 for new members, a restart for a new identity or
config, a stop, or nothing. Its own module because it is the agent's only writer of
files and the only caller of the supervisor: a stop, restart or retry is carried out
only as an order of the daemon's gate (`carry_out`, `imexd.agent.gate`), asked for
through `gate` (`NodeCore.order`). Its task (`run`) runs the rounds the core paces
(`NodeCore.reconcile_next`), each bounded and its failure contained.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import msgspec
import structlog

from imexd.agent.actions import Action, Apply, AwaitView, Pause, ProveLink, StepSoon
from imexd.agent.core import NodeCore
from imexd.agent.gate import DaemonOrder, Kind
from imexd.agent.inputs import Proven, Reconciled
from imexd.agent.pacer import until
from imexd.daemon.state import DaemonState
from imexd.daemon.supervisor import Supervisor
from imexd.errors import FileWriteError
from imexd.facts import LastWrite
from imexd.files import read_text_or_empty, write_atomic, write_file
from imexd.health.guard import BEAT_S, Guard, describe
from imexd.health.metrics import Metrics
from imexd.membership.desired import Desired
from imexd.messages import now as wire_now
from imexd.nodestate import NodeState
from imexd.render import remove_hosts_block, render_files
from imexd.settings import Settings

Probe = Literal["now", "soon"]
"""When the agent should probe the daemon after a reconcile."""
Gate = Callable[[Kind, str, "tuple[str, str, int] | None", Desired], DaemonOrder | None]
"""`NodeCore.order`: the order to stop or restart a daemon started as the given identity
(None: none of ours runs) while `desired` should run; None: keep it."""


class Applied(msgspec.Struct, frozen=True, kw_only=True):
    """What the running daemon was started (or last reloaded) with."""

    config: str
    nodes_config: str
    identity: tuple[str, str, int]
    members: MappingProxyType[int, str]


class Reconciler:
    """The files and the daemon as last applied, and why the last write failed."""

    def __init__(
        self,
        settings: Settings,
        supervisor: Supervisor,
        *,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        current: Callable[[], Desired],
        gate: Gate,
    ) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.metrics = metrics
        self.log = log
        self.current = current
        """The agent's `desired` as of now: a start waits for it to still hold."""
        self.gate = gate
        self.applied: Applied | None = None
        self.first = True
        self.write_error = ""
        self.write_path = ""
        self.write_method: LastWrite = "rename"
        self.write_failures = 0

    async def run(
        self,
        core: NodeCore,
        guard: Guard,
        *,
        dirty: asyncio.Event,
        stepped: asyncio.Event,
        changed: asyncio.Event,
        prove: Callable[[], Awaitable[bool]],
        carry: Callable[[list[Action]], Awaitable[None]],
    ) -> None:
        """The `reconcile` task: a round each time `dirty` is set (or a failed one is due
        again), paced by the core. `stepped` is set after each membership step, `changed`
        here after each round; `prove` makes a round trip through the broker (False when
        it did not come back within the link's ping timeout, or the link ended); `carry`
        carries out the core's actions."""
        while True:
            guard.heartbeats.beat("reconcile")
            retry_at = core.rounds.retry_at
            await guard.rest("reconcile", dirty, retry_at)
            if not dirty.is_set() and (retry_at is None or time.monotonic() < retry_at):
                continue
            members = None if self.applied is None else self.applied.members
            match core.reconcile_next(time.monotonic(), members):
                case Pause(until=until_at):
                    await asyncio.sleep(until_at - time.monotonic())
                case ProveLink(mark):
                    # A round trip is bounded by the link's own ping timeout, however long
                    # the link's round trips are: waiting on the broker is not being wedged.
                    with guard.heartbeats.resting("reconcile"):
                        proven = Proven(mark, await prove())
                    core.feed(proven, now=time.monotonic(), wall=wire_now())
                case AwaitView():
                    await until(lambda: core.view_ready, stepped, BEAT_S)
                case Apply(desired, saved, retry):
                    dirty.clear()
                    if retry is not None:
                        await self.carry_out(retry)
                        await carry([StepSoon()])  # claim again a slot a FATAL daemon gave up
                    await self._round(core, guard, desired, saved, carry)
                    changed.set()

    async def _round(
        self,
        core: NodeCore,
        guard: Guard,
        desired: Desired,
        saved: NodeState,
        carry: Callable[[list[Action]], Awaitable[None]],
    ) -> None:
        """One round: `apply`, bounded by the supervisor's timeouts; a failure is tried
        again on the core's backoff and said in DaemonReady (with its traceback logged,
        unless it is a failed write)."""
        d = self.settings.daemon
        started = time.monotonic()
        bound = 2 * d.stop_timeout_s + d.start_s
        try:
            probe = await guard.beating("reconcile", self.apply(desired, saved), limit=bound)
        except Exception as exc:
            # Nothing was applied that the next round would not redo.
            self.write_failures += 1
            core.feed(Reconciled(ok=False), now=time.monotonic(), wall=wire_now())
            retry_in_s = round((core.rounds.retry_at or started) - time.monotonic(), 2)
            if isinstance(exc, FileWriteError):
                self.log.warning("reconcile.write_failed", error=str(exc), retry_in_s=retry_in_s)
            else:
                self.write_error, self.write_path = f"reconcile failed: {describe(exc)}", ""
                error = describe(exc)
                self.log.error("reconcile.failed", error=error, retry_in_s=retry_in_s, exc_info=exc)
        else:
            self.write_error = self.write_path = ""
            # "soon": the start or the paced SIGUSR1 starts the domain probes, not this write.
            ended = Reconciled(ok=True, probe_now=probe == "now")
            await carry(core.feed(ended, now=time.monotonic(), wall=wire_now()))
        self.metrics.observe_reconcile(time.monotonic() - started)

    async def apply(self, desired: Desired, saved: NodeState) -> Probe | None:
        """Write the files `desired` implies and bring the daemon in line with them.

        Returns when to probe the daemon next: "now" after a stop, "soon" after a
        change of files or members (once the start or the SIGUSR1 it asked for has
        happened), None when a newer `desired` superseded this one or the gate kept
        the daemon.
        """
        supervisor = self.supervisor
        first, self.first = self.first, False
        running = None if self.applied is None else self.applied.identity
        if not desired.run or desired.domain is None or desired.slot is None:
            if self.applied is not None or supervisor.state is not DaemonState.STOPPED:
                why = "not a settled member" if not desired.cleanup else "left"
                if not await self.carry_out(self.gate("stop", why, running, desired)):
                    return None
            elif first and desired.cleanup:
                why = "this node is in no domain"
                await self.carry_out(self.gate("end_strays", why, None, desired))
            self.applied = None
            if desired.cleanup:
                await asyncio.to_thread(self.remove_files)
            return "now"
        s = self.settings
        hosts_path = s.imex.hosts_file
        current_hosts = await asyncio.to_thread(read_text_or_empty, hosts_path)
        files = render_files(
            s,
            domain=desired.domain,
            clique=desired.clique,
            slots={slot: m.address for slot, m in desired.members.items()},
            hosts_current=current_hosts,
        )
        config_changed = await self.write(s.config_path, files.config)
        nodes_changed = await self.write(s.nodes_config_path, files.nodes_config)
        await self.write(Path(hosts_path), files.hosts, in_place_ok=True, label="hosts")
        identity = (desired.domain, desired.clique, desired.slot)
        now_desired = self.current()
        if self.applied is None and (now_desired.run, now_desired.slot) != (True, desired.slot):
            # Membership moved our slot (or called the start off) while the files were
            # written: never start a daemon on a slot we may no longer hold. The change
            # set `dirty`, so the next round writes and starts on the current view.
            self.log.info("reconcile.superseded", slot=desired.slot, now=now_desired.slot)
            return None
        applied = Applied(
            config=files.config,
            nodes_config=files.nodes_config,
            identity=identity,
            members=MappingProxyType({slot: m.address for slot, m in desired.members.items()}),
        )
        previous = self.applied
        if previous is None:
            self.applied = applied
            was = (saved.domain, saved.clique, saved.slot)
            adopt = not config_changed and not nodes_changed and was == identity
            self.log.info("reconcile.start", slot=desired.slot, adopt_allowed=adopt)
            await supervisor.ensure_started(adopt=adopt)
        elif (
            previous.config != applied.config
            or previous.identity != identity
            or (s.domain.mode == "addresses" and previous.nodes_config != applied.nodes_config)
        ):
            why = "config.cfg changed" if previous.config != applied.config else "identity"
            if s.domain.mode == "addresses" and previous.nodes_config != applied.nodes_config:
                why = "member addresses changed (addresses mode)"
            self.log.info("reconcile.restart", why=why)
            if not await self.carry_out(self.gate("restart", why, previous.identity, desired)):
                return None
            self.applied = applied
        elif previous.members != applied.members:
            self.applied = applied
            self.log.info("reconcile.reload", members=len(applied.members))
            supervisor.request_reload("members changed")
        else:
            self.applied = applied
            await supervisor.ensure_started()
        return "soon"

    async def carry_out(self, order: DaemonOrder | None) -> bool:
        """Carry out an order of the daemon's gate; False when it gave none (the daemon
        keeps running: `NodeCore` logged why)."""
        if order is None:
            self.log.error("reconcile.daemon_kept", why="the daemon's gate gave no order")
            return False
        supervisor = self.supervisor
        match order.kind:
            case "stop":
                await supervisor.stop(order.why)
            case "restart":
                await supervisor.restart(order.why)
            case "retry":
                await supervisor.retry(order.why)
            case "end_strays":
                await supervisor.end_strays(order.why)
        return True

    async def write(
        self, path: Path, content: str, *, in_place_ok: bool = False, label: str | None = None
    ) -> bool:
        """Write one file (retried by the caller on FileWriteError); True if it changed."""
        name = label or path.name
        try:
            try:
                await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
            except OSError as exc:
                raise FileWriteError(str(path.parent), exc.strerror or str(exc)) from exc
            if in_place_ok:
                result = await asyncio.to_thread(
                    write_file, path, content, backup_dir=self.settings.node.state_dir
                )
                changed = result.changed
                if result.method != "unchanged":
                    self.write_method = result.method
            else:
                changed = await asyncio.to_thread(write_atomic, path, content)
        except FileWriteError as exc:
            self.metrics.count_write(name, ok=False)
            self.write_error, self.write_path = exc.reason, str(path)
            raise
        if changed:
            self.metrics.count_write(name, ok=True)
            self.log.info("file.written", path=str(path))
        return changed

    async def clean_up(self) -> None:
        """A leave's last step: `remove_files`. A file that cannot be removed (a run_dir
        below a regular file, a read-only folder) is one warning that names it; the leave
        is done all the same."""
        try:
            await asyncio.to_thread(self.remove_files)
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            error = f"cannot remove{where}: {exc.strerror or exc}"
            self.log.warning("agent.cleanup_failed", error=error)

    def remove_files(self) -> None:
        """Remove our hosts block and the IMEX files (left the domain)."""
        s = self.settings
        current = read_text_or_empty(s.imex.hosts_file)
        cleaned = remove_hosts_block(current)
        if cleaned != current:
            write_file(s.imex.hosts_file, cleaned, backup_dir=s.node.state_dir)
        for path in (s.config_path, s.nodes_config_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
