"""Benchmark: imexd's membership beside Serf's, the same figures on the same machine.

    .venv/bin/python bench/serf.py                 # 18 nodes, 3 rounds
    .venv/bin/python bench/serf.py --nodes 18 --rounds 5 --json out.json

Serf (HashiCorp's gossip membership, `serf` on PATH: Debian's package) and imexd are run
in turns, round 1 Serf, round 1 imexd, round 2 Serf, ..., each round on a fresh cluster,
so that both meet the same load on a shared machine. Every figure is defined the same way
for both, and every wait is bounded (a miss is an error of the round, never hidden):

1. formation: N agents. Serf: the first agent (the seed every other one `-join`s) is
   started and answers its RPC, then the other N - 1 are started at once; imexd: the
   broker is up, then all N agents start at once. From the last agent's start until every
   agent lists all N as alive.
2. leave: one agent leaves gracefully (Serf: SIGINT, its graceful leave; imexd: its stop
   event, what SIGTERM does): until no other agent lists it as alive.
3. join: one more agent starts: until every agent, the new one included, lists every
   member as alive.
4. crash: one agent gets SIGKILL: until no other agent lists it as alive (Serf: failed;
   imexd: its will, after the Will Delay, and its peers' steps).

What "lists" means:
- Serf: the agent's member list as its RPC answers `members` (what `serf members`
  prints), polled on one RPC connection per agent every `--poll-ms` (10 ms); alive is the
  status `alive` (`leaving`, `left` and `failed` are not). The agents' event stream is not
  used: the Serf agent coalesces member events (at least a second of quiet) before it
  hands them to event handlers and streams.
- imexd: bench/formation.py's own run (its `Run`, the code path of the figures of
  docs/performance.md's "Formation, join, leave and crash"): `--daemons none`, agents in
  this process, the shipped settings but `[bus] will_delay_s` = 2 s, on a private
  Mosquitto; an agent's view is its settled membership, looked at every 5 ms. The crash
  victim is the `imexd run` process that formation.py joins before its crash phase (after
  a second leave when the group is full), as there.

Serf runs as shipped: `serf agent -node NAME -bind 127.0.0.1:PORT -rpc-addr
127.0.0.1:PORT [-join 127.0.0.1:SEED]`, the `lan` profile (memberlist's LAN defaults,
printed with the figures), plus an empty `-config-dir` in the run's folder (no settings:
it only puts the folder on the command line, for the sweep below). Everything is on
loopback.

Every process the script starts (Serf agents, the broker, the imexd agent process) has
the run's work folder on its command line; on exit, failure, SIGINT or SIGTERM the script
kills its Serf agents, ends imexd's agents as formation.py does, then kills whatever still
runs from that folder, and removes the folder (`--keep` keeps it, with the agents' logs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

import formation
import msgspec
import psutil
from harness import BenchError, cpu_total, first_line, log_agents, machine, pids_alive, sweep

from imexd.demo.brokers import free_port

FIGURES: Final = ("formation", "join", "leave", "crash")
TARGET_N: Final = 18
TARGET_RATIO: Final = 1.5
"""The target: a formation of 18 at least this many times faster than Serf's."""
WILL_DELAY_S: Final = 2.0
"""imexd's `[bus] will_delay_s` in this benchmark (formation.py's default)."""
SERF_LAN: Final = (
    "Serf's `lan` profile (memberlist DefaultLANConfig): probe every 1 s, probe timeout "
    "0.5 s, 3 indirect probes, suspicion multiplier 4 (a suspect is declared failed after "
    "4 x log10(N) x 1 s at the least, 6 times that at most, shorter as peers confirm), "
    "gossip every 200 ms to 3 nodes, push-pull every 30 s"
)
START_LIMIT_S: Final = 20.0
"""A Serf agent answers its RPC at most this long after its start."""
PHASE_LIMIT_S: Final = 30.0
"""A formation, leave or join converges at most this long after it began."""
CRASH_LIMIT_S: Final = 90.0
"""Serf's suspicion timeout is at most 6 x 4 x log10(N) probe intervals (30 s at 18)."""


# Serf's RPC: msgpack over TCP, a header then a body ------------------------------------


def msgpack_end(buf: bytes | bytearray, pos: int) -> int | None:
    """Where the msgpack object that starts at `pos` ends (None: not all in `buf` yet)."""
    todo = 1
    size = len(buf)
    while todo:
        if pos >= size:
            return None
        b = buf[pos]
        todo -= 1
        head, extra = 1, 0
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            pass
        elif 0x80 <= b <= 0x8F:
            todo += 2 * (b & 0x0F)
        elif 0x90 <= b <= 0x9F:
            todo += b & 0x0F
        elif 0xA0 <= b <= 0xBF:
            extra = b & 0x1F
        elif b in (0xCC, 0xD0, 0xD4):
            head = 2 + (1 if b == 0xD4 else 0)
        elif b in (0xCD, 0xD1, 0xD5):
            head = 3 + (1 if b == 0xD5 else 0)
        elif b in (0xCA, 0xCE, 0xD2, 0xD6):
            head = 5 + (1 if b == 0xD6 else 0)
        elif b in (0xCB, 0xCF, 0xD3, 0xD7):
            head = 9 + (1 if b == 0xD7 else 0)
        elif b == 0xD8:
            head = 18
        else:
            width = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4, 0xD9: 1, 0xDA: 2}
            width |= {0xDB: 4, 0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
            if b not in width:
                raise ValueError(f"msgpack: unknown type byte {b:#x}")
            n = width[b]
            if pos + 1 + n > size:
                return None
            count = int.from_bytes(buf[pos + 1 : pos + 1 + n], "big")
            head = 1 + n + (1 if b in (0xC7, 0xC8, 0xC9) else 0)  # ext: its type byte
            if b in (0xDC, 0xDD):
                todo += count
            elif b in (0xDE, 0xDF):
                todo += 2 * count
            else:
                extra = count
        pos += head + extra
    return pos if pos <= size else None


class SerfMember(msgspec.Struct):
    Name: str
    Status: str


class MembersBody(msgspec.Struct):
    Members: list[SerfMember]


class Header(msgspec.Struct):
    Seq: int
    Error: str = ""


class SerfRpc:
    """One RPC connection to a Serf agent (after its handshake); one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.seq = 0

    @classmethod
    async def connect(cls, port: int) -> SerfRpc:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        rpc = cls(reader, writer)
        try:
            await rpc.call("handshake", {"Version": 1}, body=False)
        except BaseException:
            rpc.close()
            raise
        return rpc

    async def _object(self) -> bytes:
        while True:
            end = msgpack_end(self.buf, 0)
            if end is not None:
                raw = bytes(self.buf[:end])
                del self.buf[:end]
                return raw
            chunk = await self.reader.read(65536)
            if not chunk:
                raise ConnectionError("Serf RPC: connection closed")
            self.buf += chunk

    async def call(self, command: str, request: Any = None, *, body: bool) -> bytes | None:
        """Send `command` (with `request` as its body, if any); its response's body (None
        when `body` is False: the command answers with a header only)."""
        seq = self.seq
        self.seq += 1
        out = msgspec.msgpack.encode({"Command": command, "Seq": seq})
        if request is not None:
            out += msgspec.msgpack.encode(request)
        self.writer.write(out)
        await self.writer.drain()
        header = msgspec.msgpack.decode(await self._object(), type=Header)
        if header.Seq != seq:
            raise ConnectionError(f"Serf RPC: answer to {header.Seq}, expected {seq}")
        if header.Error:
            raise ConnectionError(f"Serf RPC {command}: {header.Error}")
        return await self._object() if body else None

    async def members(self) -> dict[str, str]:
        """name -> status (alive, leaving, left, failed) of every member it knows."""
        raw = await self.call("members", body=True)
        assert raw is not None
        return {m.Name: m.Status for m in msgspec.msgpack.decode(raw, type=MembersBody).Members}

    def close(self) -> None:
        self.writer.close()


# Serf agents -----------------------------------------------------------------------------


class SerfAgent:
    """One `serf agent` process and what its RPC last said."""

    def __init__(self, root: Path, name: str, poll_s: float) -> None:
        self.name = name
        self.dir = root / name
        self.dir.mkdir(parents=True)
        (self.dir / "config").mkdir()
        self.port = free_port()
        self.rpc_port = free_port()
        self.poll_s = poll_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.statuses: dict[str, str] = {}
        self.alive_view: frozenset[str] = frozenset()
        self.view_at = 0.0
        """When `alive_view` last changed (the poll whose answer changed it)."""
        self.changes: list[tuple[float, str, str]] = []
        """(when seen, member, its new status)."""
        self._task: asyncio.Task[None] | None = None
        self.problem = ""
        """The last error of its RPC while it ran (shown when a wait fails)."""

    @property
    def bind(self) -> str:
        return f"127.0.0.1:{self.port}"

    def argv(self, join: str | None) -> list[str]:
        argv = ["serf", "agent", "-node", self.name, "-bind", self.bind]
        argv += ["-rpc-addr", f"127.0.0.1:{self.rpc_port}", "-config-dir", str(self.dir / "config")]
        return argv + (["-join", join] if join else [])

    def start(self, join: str | None) -> None:
        with (self.dir / "serf.log").open("ab") as out:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                self.argv(join),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._task = asyncio.create_task(self._watch(), name=f"serf-{self.name}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(sig)

    async def exited(self, limit_s: float) -> int | None:
        deadline = time.monotonic() + limit_s
        while self.proc is not None and time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                return code
            await asyncio.sleep(0.02)
        return None if self.proc is None else self.proc.poll()

    async def _watch(self) -> None:
        """Poll its member list every `poll_s` while it runs (connect first, retried)."""
        rpc: SerfRpc | None = None
        try:
            while self.alive:
                if rpc is None:
                    with contextlib.suppress(OSError):  # not listening yet
                        rpc = await SerfRpc.connect(self.rpc_port)
                    if rpc is None:
                        await asyncio.sleep(0.005)
                        continue
                try:
                    statuses = await rpc.members()
                except (OSError, ValueError, msgspec.MsgspecError) as exc:
                    rpc.close()
                    rpc = None
                    if self.alive:
                        self.problem = f"{type(exc).__name__}: {exc}"
                        await asyncio.sleep(0.005)
                    continue
                now = time.monotonic()
                self.problem = ""
                for member, status in statuses.items():
                    if self.statuses.get(member) != status:
                        self.changes.append((now, member, status))
                self.statuses = statuses
                view = frozenset(m for m, s in statuses.items() if s == "alive")
                if view != self.alive_view:
                    self.alive_view, self.view_at = view, now
                await asyncio.sleep(self.poll_s)
        finally:
            if rpc is not None:
                rpc.close()

    def describe(self) -> str:
        problem = f" (its RPC: {self.problem})" if self.problem else ""
        return f"{self.name} lists {len(self.alive_view)} alive{problem}"

    def first_change(self, member: str, after: float, test: Callable[[str], bool]) -> float | None:
        """When it first saw `member` in a status that passes `test`, after `after`."""
        return next((t for t, m, s in self.changes if t >= after and m == member and test(s)), None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)


@dataclass
class Round:
    """One round of one system: its figures (seconds) and the load when it began."""

    system: str
    index: int
    load: float
    figures: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    error: str = ""


class SerfCluster:
    """One Serf round: N agents on loopback, the four phases."""

    def __init__(self, root: Path, n: int, poll_s: float, rnd: Round) -> None:
        self.root = root
        self.n = n
        self.poll_s = poll_s
        self.round = rnd
        self.agents: list[SerfAgent] = []
        self.seed: SerfAgent | None = None

    def new_agent(self, name: str) -> SerfAgent:
        agent = SerfAgent(self.root, name, self.poll_s)
        self.agents.append(agent)
        return agent

    def live(self) -> list[SerfAgent]:
        return [a for a in self.agents if a.alive]

    async def wait(
        self, test: Callable[[SerfAgent], bool], agents: Sequence[SerfAgent], what: str
    ) -> float:
        """Until `test` holds for each of `agents` (their last polls): the time the last one
        made it true (the answer that changed its alive view last)."""
        limit_s = CRASH_LIMIT_S if what == "crash" else PHASE_LIMIT_S
        deadline = time.monotonic() + limit_s
        while not all(test(a) for a in agents):
            if time.monotonic() > deadline:
                late = [a.describe() for a in agents if not test(a)]
                raise BenchError(f"Serf {what}: not converged in {limit_s:g} s: {late[:4]}")
            await asyncio.sleep(0.005)
        return max(a.view_at for a in agents)

    async def execute(self) -> None:
        r = self.round
        seed = self.seed = self.new_agent("serf-000")
        seed.start(None)
        await self.wait(lambda a: a.alive_view == {a.name}, [seed], "seed start")
        rest = [self.new_agent(f"serf-{i:03d}") for i in range(1, self.n)]
        me = psutil.Process()
        mine0 = me.cpu_times()
        for agent in rest:
            agent.start(seed.bind)
        t0 = rest[-1].started_at if rest else seed.started_at
        names = frozenset(a.name for a in self.agents)
        t1 = await self.wait(lambda a: a.alive_view == names, self.agents, "formation")
        mine1 = me.cpu_times()
        agents_cpu = cpu_total(pids_alive(a.proc.pid for a in self.agents if a.proc))
        mine = mine1.user + mine1.system - mine0.user - mine0.system
        r.figures["formation"] = t1 - t0
        r.notes["formation"] = (
            f"the first start -> all alive {t1 - seed.started_at:.3f} s; CPU of the {self.n} "
            f"agents from their start {agents_cpu / self.n * 1000:.0f} ms each; the "
            f"benchmark's polling {mine * 1000:.0f} ms"
        )
        await asyncio.sleep(0.5)

        leaver = self.agents[-1]
        others = [a for a in self.agents if a is not leaver]
        t0 = time.monotonic()
        leaver.signal(signal.SIGINT)
        t1 = await self.wait(lambda a: leaver.name not in a.alive_view, others, "leave")
        r.figures["leave"] = t1 - t0
        left = await self._all_see(leaver.name, others, t0, lambda s: s == "left")
        code = await leaver.exited(15)
        r.notes["leave"] = (
            f"every other agent lists it `left` (its member-leave event) {left - t0:.3f} s; "
            f"the agent exited with {code}"
        )
        await leaver.stop()
        await asyncio.sleep(0.5)

        joiner = self.new_agent(f"serf-{self.n:03d}")
        joiner.start(seed.bind)
        t0 = joiner.started_at
        names = frozenset(a.name for a in self.live())
        t1 = await self.wait(lambda a: a.alive_view == names, self.live(), "join")
        r.figures["join"] = t1 - t0
        await asyncio.sleep(0.5)

        victim = joiner
        others = [a for a in self.live() if a is not victim]
        t0 = time.monotonic()
        victim.signal(signal.SIGKILL)
        t1 = await self.wait(lambda a: victim.name not in a.alive_view, others, "crash")
        r.figures["crash"] = t1 - t0
        first = min(a.view_at for a in others)
        r.notes["crash"] = f"first peer {first - t0:.3f} s"
        await victim.stop()

    async def _all_see(
        self, member: str, agents: Sequence[SerfAgent], after: float, test: Callable[[str], bool]
    ) -> float:
        """When the last of `agents` saw `member` in a status that passes `test` (bounded)."""
        deadline = time.monotonic() + PHASE_LIMIT_S
        while True:
            seen = [a.first_change(member, after, test) for a in agents]
            if all(t is not None for t in seen):
                return max(t for t in seen if t is not None)
            if time.monotonic() > deadline:
                raise BenchError(f"Serf: {member} not seen by every agent in {PHASE_LIMIT_S:g} s")
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        for agent in self.agents:
            await agent.stop()
        sweep(self.root)


# imexd: bench/formation.py's run ---------------------------------------------------------


def imexd_options(n: int) -> formation.Options:
    """bench/formation.py's options for `--nodes N --daemons none --phases domain`."""
    return formation.Options(
        nodes=(n,),
        daemons=(False,),
        group_size=n,
        max_nodes=max(n, 18),
        will_delay_s=WILL_DELAY_S,
        idle_s=0.0,
        repeat=1,
        keep=False,
        workdir=None,
        json_out=None,
        profile=None,
        max_load=None,
        probe_interval_s=None,
        domain_probe_interval_s=None,
        agents="inproc",
        timings="shipped",
        phases=("domain",),
    )


def figure(run: formation.Run, name: str) -> float:
    value = next((f.value for f in run.result.figures if f.name == name), None)
    if value is None:
        raise BenchError(f"imexd: no figure {name!r}")
    return value


async def imexd_round(root: Path, n: int, rnd: Round, octet: int, log_out: TextIO) -> None:
    """formation.py's phases but its idle sampling, on its own broker in `root`."""
    run = formation.Run(imexd_options(n), n, daemons=False, root=root, octet=octet)
    log_agents(log_out, run.capture)
    r = rnd
    try:
        groups = await run._start()
        await run._formation(groups)
        startup = figure(run, "startup: start -> last agent connected")
        formed = figure(run, "formation: last connected -> all memberships final")
        r.figures["formation"] = startup + formed
        cpu = figure(run, "formation: CPU of the in-process agents")
        r.notes["formation"] = (
            f"last link up -> all final {formed:.3f} s; CPU {cpu / n * 1000:.0f} ms per agent, "
            "all in this process's one event loop"
        )
        await run._leave()
        r.figures["leave"] = figure(run, "leave: stop -> visible on all")
        await run._join()
        joiner = next(node for node in run.nodes if node.name == "join-000")
        up = joiner.connected_at()
        if up is None:
            raise BenchError("imexd join: the joiner's link never came up")
        visible = figure(run, "join: connected -> visible on all") + up
        r.figures["join"] = visible - joiner.started_at
        r.notes["join"] = f"link up -> visible {visible - up:.3f} s"
        await run._join_process()
        await run._crash()
        r.figures["crash"] = figure(run, "crash: SIGKILL -> visible on all")
        will = next((f for f in run.result.figures if "will delivered by" in f.name), None)
        if will is not None and will.value is not None:
            r.notes["crash"] = f"the broker delivered the will at {will.value:.3f} s"
    finally:
        await run.close()
    if run.result.error:
        raise BenchError(run.result.error)


# Rounds and the table ------------------------------------------------------------------


def spread(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.3f} s"
    return f"{med:.3f} s ({min(values):.3f}..{max(values):.3f})"


def print_table(rounds: Sequence[Round], n: int) -> bool | None:
    """The comparison; the verdict of the formation target (None: not measured at 18)."""
    serf = [r for r in rounds if r.system == "serf" and not r.error]
    imexd = [r for r in rounds if r.system == "imexd" and not r.error]
    print(f"\nSerf and imexd, {n} nodes: median (min..max) of {len(serf)} and {len(imexd)} rounds")
    print(f"  {'figure':<10} {'Serf':>26} {'imexd':>26} {'Serf/imexd':>11}")
    verdict: bool | None = None
    for name in FIGURES:
        s = [r.figures[name] for r in serf if name in r.figures]
        m = [r.figures[name] for r in imexd if name in r.figures]
        ratio = statistics.median(s) / statistics.median(m) if s and m else None
        shown = "n/a" if ratio is None else f"{ratio:.2f}"
        print(f"  {name:<10} {spread(s):>26} {spread(m):>26} {shown:>11}")
        if name == "formation" and ratio is not None and n == TARGET_N:
            verdict = ratio >= TARGET_RATIO
    crashes = [r.figures["crash"] for r in imexd if "crash" in r.figures]
    if crashes:
        print(
            f"  imexd's crash: will delay {WILL_DELAY_S:g} s (5 s shipped) + "
            f"{statistics.median(crashes) - WILL_DELAY_S:.3f} s; Serf's: its failure "
            "detector as above"
        )
    loads = [r.load for r in rounds]
    if loads:
        print(f"  1-min load average at the rounds' starts: {min(loads):.2f} to {max(loads):.2f}")
    if verdict is not None:
        word = "PASS" if verdict else "MISS"
        print(f"  target: formation of {TARGET_N} at least {TARGET_RATIO:g} x Serf's speed: {word}")
    for r in rounds:
        if r.error:
            print(f"  round {r.index} {r.system}: ERROR {r.error}")
    return verdict


def print_round(r: Round) -> None:
    shown = ", ".join(f"{k} {v:.3f} s" for k, v in r.figures.items())
    print(f"round {r.index} {r.system} (load {r.load:.2f}): {shown or 'no figures'}", flush=True)
    for k, v in r.notes.items():
        print(f"    {k}: {v}")
    if r.error:
        print(f"    ERROR: {r.error}", flush=True)


async def bench(args: argparse.Namespace, base: Path, log_out: TextIO) -> list[Round]:
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    octet = 250 + os.getpid() % 5
    rounds: list[Round] = []
    for i in range(1, args.rounds + 1):
        if args.max_load is not None:
            await formation.wait_for_load(args.max_load, 300.0)
        for system in ("serf", "imexd"):
            rnd = Round(system, i, os.getloadavg()[0])
            root = base / f"round{i}-{system}"
            root.mkdir()
            try:
                if system == "serf":
                    cluster = SerfCluster(root, args.nodes, args.poll_ms / 1000, rnd)
                    try:
                        await cluster.execute()
                    finally:
                        await cluster.close()
                else:
                    await imexd_round(root, args.nodes, rnd, octet, log_out)
            except (BenchError, TimeoutError) as exc:
                rnd.error = str(exc) or type(exc).__name__
            rounds.append(rnd)
            print_round(rnd)
            if not args.keep and not rnd.error:
                shutil.rmtree(root, ignore_errors=True)
    return rounds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=TARGET_N, help="agents of each (18)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, in turns (3)")
    parser.add_argument(
        "--poll-ms", type=float, default=10.0, help="Serf: members polled every (10 ms)"
    )
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="before each round of both wait (at most 5 min) for the 1-min loadavg to drop "
        "below this",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    parser.add_argument("--workdir", type=Path, default=None, help="parent of the work folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the rounds here")
    args = parser.parse_args(argv)
    if args.nodes < 3 or args.rounds < 1:
        parser.error("--nodes: at least 3; --rounds: at least 1")
    if shutil.which("serf") is None:
        print("serf is not on PATH: apt-get install serf (Debian's package)", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="imexd-serf-", dir=args.workdir))
    command = shlex.join([Path(sys.executable).name, "bench/serf.py", *sys.argv[1:]])
    print(f"command: {command}")
    print(f"machine: {machine()}")
    print(f"serf: Debian package {debian_version('serf')}, `serf version`: {serf_version()}")
    print(f"Serf: {SERF_LAN}; its RPC `members` polled every {args.poll_ms:g} ms")
    print(
        f"imexd: bench/formation.py --nodes {args.nodes} --daemons none --phases domain "
        f"(in process, shipped settings, [bus] will_delay_s = {WILL_DELAY_S:g} s; views "
        f"every {formation.POLL_S * 1000:g} ms)"
    )
    print(f"work folder: {base}", flush=True)
    rounds: list[Round] = []
    try:
        with (base / "agents.log").open("w") as log_out:
            rounds = asyncio.run(bench(args, base, log_out))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: cleaning up")
        return 130
    finally:
        sweep(base)
        if args.keep or any(r.error for r in rounds):
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    verdict = print_table(rounds, args.nodes)
    if args.json is not None:
        data = {
            "command": command,
            "machine": machine(),
            "rounds": [r.__dict__ for r in rounds],
        }
        args.json.write_text(json.dumps(data, indent=1))
    return 1 if any(r.error for r in rounds) or verdict is False else 0


def serf_version() -> str:
    return first_line(["serf", "version"])


def debian_version(package: str) -> str:
    try:
        proc = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Version}", package],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return proc.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
