"""Benchmark: `imexd domain create` for a new job on a broker that holds a whole fleet.

    .venv/bin/python bench/fleet_create.py
    .venv/bin/python bench/fleet_create.py --fleet 256,1024 --runs 7

A fresh Mosquitto gets the retained records of a running fleet of N nodes (a member
record and a health report each, in domains of 8, and a presence each), plus the
presences of two idle nodes per run. Then `imexd domain create jobR --nodes a,b` for
those two idle nodes runs as a Slurm prolog runs it (its checks on: another live domain,
a live agent), one process after the other; each line gives the median seconds from
spawn to exit over the runs, and (min..max). What a command reads is what it checks: the
figure shows whether a job start pays for the size of the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiomqtt
from harness import ROOT, broker_target, compile_bytecode

from imexd.messages import Presence, encode
from imexd.topics import Topics
from tests.reports import member_record, report

IMEXD = ROOT / ".venv" / "bin" / "imexd"
DOMAIN_SIZE = 8
T = Topics("imex/v2")


async def fill(host: str, port: int, fleet: int, runs: int) -> None:
    """Retain the fleet's records and the idle nodes' presences (QoS 1, acknowledged)."""
    now = time.time()
    async with aiomqtt.Client(host, port, identifier="bench-fill") as client:
        for i in range(fleet):
            node, domain, slot = f"n{i:05d}", f"s{i // DOMAIN_SIZE}", i % DOMAIN_SIZE
            records = {
                T.member(domain, "c1", node): encode(member_record(node, slot, domain=domain)),
                T.health(domain, node): encode(report(node, slot, {}, domain=domain, at=now)),
                T.presence(node): encode(
                    Presence(node=node, incarnation=1, at=now, domain=domain, address="10.0.0.1")
                ),
            }
            for topic, payload in records.items():
                await client.publish(topic, payload, qos=1, retain=True)
        for run in range(runs):
            for node in (f"j{run}a", f"j{run}b"):
                idle = Presence(node=node, incarnation=1, at=now, domain=None, address="10.0.0.2")
                await client.publish(T.presence(node), encode(idle), qos=1, retain=True)


def one_fleet(fleet: int, runs: int) -> str:
    """The line of one fleet size."""
    with tempfile.TemporaryDirectory(prefix="imexd-fleet-create-") as folder:
        broker = broker_target("mosquitto", Path(folder) / "broker")
        broker.start()
        try:
            asyncio.run(fill(*broker.endpoint, fleet, runs))
            env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
            env["IMEXD_BUS_URL"] = broker.urls[0]
            took = []
            for run in range(runs):
                command = [str(IMEXD), "domain", "create", f"job{run}", "--nodes"]
                command.append(f"j{run}a,j{run}b")
                started = time.monotonic()
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                took.append(time.monotonic() - started)
                if done.returncode != 0:
                    return f"fleet {fleet}: domain create exited {done.returncode}: {done.stderr}"
        finally:
            broker.stop()
    return (
        f"fleet {fleet}: domain create of 2 idle nodes, spawn -> exit, median of {runs}: "
        f"{statistics.median(took):.3f} s ({min(took):.3f}..{max(took):.3f})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleet", default="1024", help="comma-separated fleet sizes (1024)")
    parser.add_argument("--runs", type=int, default=7, help="commands per fleet size (7)")
    args = parser.parse_args()
    compile_bytecode()
    for fleet in (int(n) for n in args.fleet.split(",")):
        print(one_fleet(fleet, args.runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
