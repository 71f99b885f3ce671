"""Benchmark: what a command costs to start, and what an idle agent costs to keep.

    .venv/bin/python bench/startup.py
    .venv/bin/python bench/startup.py --tree /path/to/other/checkout   # "before"

Figures, each the median (min..max) over `--runs` runs, wall clock, and for the programs
that exit their CPU time (user + system), which a loaded machine does not inflate:
- `python -c pass`: the interpreter's own start on this machine, the floor of the rest;
- `imexd --version`: a control command's start (argument parsing, no broker);
- `imexd-sim-ctl -q`: one probe of a running simulated daemon (what the agent runs every
  probe interval, and at every daemon start);
- `imexd-sim-ctl -N -j`: one domain probe of the same one-node domain (what the agent runs
  after a start, a SIGUSR1 or the daemon's news of a link, and every domain probe
  interval);
- `imexd-sim-daemon`: from its spawn until its first line on stderr (the daemon's start
  as the agent sees it);
- `imexd domain create`: from its spawn until the broker delivers the spec it writes to
  this process (a prolog's command reaching the bus: its start, imports, connect and
  one publish), and until it exits (without `--wait`: its read, write and check);
- one `imexd run` agent (tests.cluster's node: a simulated daemon, the fast timings) in a
  formed one-node domain: its RSS (max) and CPU (% of one core) over `--idle-s` seconds;
- the daemon's READY line -> the node's ready report: per run a new one-node domain whose
  simulated daemon says READY `READY_DELAY_S` after its start (after the fast timings'
  `start_s`, with the shipped `probe_interval_s`), from the line's appearance in the
  daemon's output file to the broker's delivery of the first report with `ready`, both
  seen by this process (it looks every `LOOK_S`);
- the daemon's spawn -> RUNNING: per run a new one-node domain with the shipped `start_s`
  and `probe_interval_s`, whose simulated daemon says READY `READY_DELAY_S` after its
  start; both moments from the agent's own log (`daemon.state` to STARTING and to
  RUNNING), and the READY line's read (its `daemon.output` event) -> RUNNING.
  `--spawn-only` measures this figure alone.

`--tree PATH` runs every program from another checkout of imexd (PYTHONPATH, this
virtual environment's interpreter and packages), so that two versions compare on the
same machine in the same minute. The machine's load is printed with the figures: on a
shared machine they move with it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
from harness import ROOT, compile_bytecode

from imexd.daemon.output import OUTPUT_FILES
from tests.cluster import Cluster

VENV_BIN = Path(sys.executable).parent
LIMIT_S = 60.0
"""Bound of every wait (the agent's readiness, a daemon's first line)."""
READY_DELAY_S = "1.0"
"""IMEXD_SIM_START_DELAY_S of the READY-line figure's daemons."""
LOOK_S = 0.002
"""How often the READY-line figure looks at the output file and the reports."""


CPU: list[float] = []
"""The CPU seconds (user + system) of each `timed` run, in order: on a loaded machine
the wall clock measures the queue for a core, the CPU time what the program costs."""


def timed(argv: Sequence[str], env: dict[str, str]) -> float:
    """Seconds `argv` took from spawn to exit (it must exit 0); its CPU time to `CPU`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=LIMIT_S)
    took = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return took


def first_line(argv: Sequence[str], env: dict[str, str]) -> float:
    """Seconds from spawning `argv` until it wrote its first line on stderr or stdout."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        took = time.perf_counter() - started
        if not line:
            raise RuntimeError(f"{argv[0]} exited without a line")
        return took
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ready_line_to_report(cluster: Cluster, name: str) -> float:
    """Seconds from the daemon's READY line in its output file to the broker's delivery of
    the node's first report with `ready` (a one-node domain of its own)."""
    timings = {"probe_interval_s": 5.0}  # the shipped one: the interval READY once waited for
    env = {"IMEXD_SIM_START_DELAY_S": READY_DELAY_S}
    overrides: dict[str, dict[str, Any]] = {
        "domain": {"max_nodes": 1},
        "daemon": timings,
        "imex": {"env": env},
    }
    with cluster.client() as bus:
        bus.record(f"imex/v2/domains/{name}/health/{name}")
        node = cluster.add(name, domain=name, overrides=overrides)
        outputs = [node.run_dir / name for name in OUTPUT_FILES.values()]
        said = ready = None
        deadline = time.monotonic() + LIMIT_S
        while ready is None and time.monotonic() < deadline:
            time.sleep(LOOK_S)
            if said is None and any(b"to READY" in _bytes(path) for path in outputs):
                said = time.monotonic()
            if any(json.loads(p).get("ready") for _, p in bus.seen() if p):
                ready = time.monotonic()
        node.stop()
    if said is None or ready is None:
        raise RuntimeError(f"{name}: no READY line ({said}) or no ready report ({ready})")
    return ready - said


def create_to_spec(cluster: Cluster, env: dict[str, str], name: str, node: str) -> float:
    """Seconds from spawning `imexd domain create NAME --nodes NODE` to the broker's
    delivery of its spec to this process; its exit's seconds to `EXITS`."""
    topic = f"imex/v2/domains/{name}/spec"
    argv = [str(VENV_BIN / "imexd"), "domain", "create", name, "--nodes", node]
    control = cluster.control_env() | {k: v for k, v in env.items() if k == "PYTHONPATH"}
    with cluster.client() as bus:
        bus.record(topic)
        started = time.perf_counter()
        proc = subprocess.Popen(
            argv, env=control, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        seen = None
        while seen is None and time.perf_counter() - started < LIMIT_S:
            if any(t == topic and p for t, p in bus.seen()):
                seen = time.perf_counter()
            else:
                time.sleep(LOOK_S / 2)
        _, err = proc.communicate(timeout=LIMIT_S)
        EXITS.append(time.perf_counter() - started)
    if seen is None or proc.returncode != 0:
        raise RuntimeError(
            f"domain create {name}: exit {proc.returncode} ({err.decode().strip()}), "
            f"spec seen: {seen is not None}"
        )
    # The node is free again for the next run's domain.
    deleted = cluster.imexd("domain", "delete", name, "--timeout", str(LIMIT_S))
    if deleted.returncode != 0:
        raise RuntimeError(f"domain delete {name}: {deleted.stdout}{deleted.stderr}")
    return seen - started


EXITS: list[float] = []
"""Seconds from spawn to exit of each `create_to_spec` command."""


def spawn_to_running(cluster: Cluster, name: str) -> tuple[float, float]:
    """Seconds from the daemon's spawn to RUNNING, and from the agent's read of its READY
    line to RUNNING, from the agent's log (a one-node domain of its own)."""
    overrides: dict[str, dict[str, Any]] = {
        "domain": {"max_nodes": 1},
        "daemon": {"start_s": 3.0, "probe_interval_s": 5.0},  # the shipped ones
        "imex": {"env": {"IMEXD_SIM_START_DELAY_S": READY_DELAY_S}},
    }
    node = cluster.add(name, domain=name, overrides=overrides)
    cluster.wait(node.ready, timeout=LIMIT_S)
    node.stop()
    states = {e["to"]: _at(e) for e in node.log_events("daemon.state")}
    said = [_at(e) for e in node.log_events("daemon.output") if "to READY" in e.get("line", "")]
    if "STARTING" not in states or "RUNNING" not in states or not said:
        raise RuntimeError(f"{name}: no start, RUNNING or READY line in its log: {states}")
    return states["RUNNING"] - states["STARTING"], states["RUNNING"] - said[0]


def _at(event: dict[str, Any]) -> float:
    """A log event's time, in seconds since the epoch."""
    return datetime.datetime.fromisoformat(event["timestamp"]).timestamp()


def _bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def spread(values: Sequence[float], scale: float = 1000.0, unit: str = "ms") -> str:
    s = sorted(values)
    return f"{statistics.median(s) * scale:.0f} {unit} ({s[0] * scale:.0f}..{s[-1] * scale:.0f})"


def p95(values: Sequence[float]) -> float:
    """The 95th percentile (nearest rank): the value 95 % of the runs did not exceed."""
    s = sorted(values)
    return s[max(0, math.ceil(0.95 * len(s)) - 1)]


def repeat(runs: int, once: Callable[[], float]) -> list[float]:
    once()  # warm the page cache and the .pyc files
    CPU.clear()
    return [once() for _ in range(runs)]


def show(what: str, walls: list[float]) -> None:
    cpu = f"; CPU {spread(CPU)}" if CPU else ""
    print(f"{what}: wall {spread(walls)}{cpu}")
    CPU.clear()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs per start figure (15)")
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle window (20 s)")
    parser.add_argument(
        "--ready-runs", type=int, default=20, help="runs of the READY-line figure (20)"
    )
    parser.add_argument(
        "--spawn-runs", type=int, default=10, help="runs of the spawn -> RUNNING figure (10)"
    )
    parser.add_argument("--spawn-only", action="store_true", help="measure only spawn -> RUNNING")
    parser.add_argument("--tree", type=Path, default=None, help="imexd checkout to measure")
    opts = parser.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
    if opts.tree is not None:
        compile_bytecode(opts.tree)
        env["PYTHONPATH"] = str(opts.tree.resolve())
        os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the agent inherits it
        os.chdir(opts.tree)  # `python -m imexd` puts its working folder first on sys.path
    py = sys.executable
    print(f"tree {opts.tree or ROOT}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if opts.spawn_only:
        spawn_figure(opts.spawn_runs)
        print(f"load {os.getloadavg()[0]:.1f}")
        return 0
    show("python -c pass", repeat(opts.runs, lambda: timed([py, "-c", "pass"], env)))
    version = [str(VENV_BIN / "imexd"), "--version"]
    show("imexd --version", repeat(opts.runs, lambda: timed(version, env)))

    root = Path(tempfile.mkdtemp(prefix="imexd-startup-"))
    cluster = Cluster(root)
    try:
        node = cluster.add("n1", overrides={"domain": {"max_nodes": 1}})
        cluster.wait(node.ready, timeout=LIMIT_S)
        config = str(node.run_dir / "config.cfg")
        ctl = [str(VENV_BIN / "imexd-sim-ctl"), "-c", config, "-q"]
        show("imexd-sim-ctl -q", repeat(opts.runs, lambda: timed(ctl, env)))
        domain = [str(VENV_BIN / "imexd-sim-ctl"), "-c", config, "-N", "-j"]
        show("imexd-sim-ctl -N -j", repeat(opts.runs, lambda: timed(domain, env)))
        # A second daemon on the agent's files, on other ports: its start-up fails or
        # serves, either way after its first line, which is all that is timed.
        daemon = [str(VENV_BIN / "imexd-sim-daemon"), "-c", config, "-p", "1"]
        sim_env = env | {"IMEXD_SIM_HOSTS_FILE": str(node.hosts_file)}
        show("imexd-sim-daemon first line", repeat(opts.runs, lambda: first_line(daemon, sim_env)))
        idle = cluster.add("n9", domain=None)  # the node each new domain names
        cluster.wait(idle.ready, timeout=LIMIT_S)
        create_to_spec(cluster, env, "warm", "n9")  # the page cache and the .pyc files
        EXITS.clear()
        creates = [create_to_spec(cluster, env, f"c{i}", "n9") for i in range(opts.runs)]
        idle.stop()
        print(
            f"imexd domain create: spawn -> spec on the bus {spread(creates)}; "
            f"-> exit {spread(EXITS)}"
        )
        assert node.proc is not None
        agent = psutil.Process(node.proc.pid)
        time.sleep(2.0)  # the start's probes and reports are over
        cpu0 = agent.cpu_times()
        rss = [agent.memory_info().rss]
        started = time.monotonic()
        while time.monotonic() - started < opts.idle_s:
            time.sleep(0.5)
            rss.append(agent.memory_info().rss)
        cpu1 = agent.cpu_times()
        busy = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        elapsed = time.monotonic() - started
        print(
            f"imexd run idle: RSS {max(rss) / 2**20:.1f} MB (max), CPU "
            f"{100 * busy / elapsed:.2f} % of a core over {elapsed:.0f} s"
        )
        node.stop()
        lags = [ready_line_to_report(cluster, f"r{i}") for i in range(opts.ready_runs)]
        print(
            f"daemon READY line -> node's ready report: {spread(lags)}, "
            f"p95 {p95(lags) * 1000:.0f} ms over {len(lags)} runs"
        )
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    spawn_figure(opts.spawn_runs)
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


def spawn_figure(runs: int) -> None:
    """Print the spawn -> RUNNING figure over `runs` new one-node domains."""
    root = Path(tempfile.mkdtemp(prefix="imexd-spawn-"))
    cluster = Cluster(root)
    try:
        spawn_to_running(cluster, "w0")  # warm the page cache and the .pyc files
        got = [spawn_to_running(cluster, f"s{i}") for i in range(runs)]
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"daemon spawn -> RUNNING: {spread([g[0] for g in got])}; its READY line read -> "
        f"RUNNING: {spread([g[1] for g in got], 1e6, 'us')}, over {len(got)} runs"
    )


if __name__ == "__main__":
    sys.exit(main())
