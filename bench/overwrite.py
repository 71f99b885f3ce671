"""Benchmark: how long a record written over a live node's own member topic stands.

    .venv/bin/python bench/overwrite.py --nodes 5

N real agents (tests/cluster.py: `imexd run` processes, simulated daemons, the demo's
fast timings) form d1 on a private Mosquitto. Then, once per node, a plain client writes
that node's member record with another address on the node's topic and watches the
topic: the figure is the time from the broker's acknowledgement of the forged record to
the node's own record arriving after it (the owner puts it back: issue 20). Each wait is
bounded (10 s); a miss is printed as MISS. Peers point the node's slot at the forged
address for about that long.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401 - first: the checkout's tests on the path

from tests.cluster import BusClient, Cluster, formed
from tests.support import loopback_address

MEMBERS = "imex/v2/domains/d1/members/c1/"
BOUND_S = 10.0


def put_back_after(client: BusClient, node: str) -> float | None:
    """Seconds from a forged record of `node` to its own record after it (None: missed)."""
    topic = MEMBERS + node
    own = client.retained(topic)[topic]
    client.record(topic)
    forged = json.dumps({**json.loads(own), "address": loopback_address()}).encode()
    start = time.monotonic()
    client.publish(topic, forged, retain=True)
    while time.monotonic() - start < BOUND_S:
        payloads = [p for _, p in client.seen()]
        if forged in payloads and own in payloads[payloads.index(forged) + 1 :]:
            return time.monotonic() - start
        time.sleep(0.001)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        cluster = Cluster(Path(root))
        try:
            nodes = [cluster.add(f"n{i}") for i in range(1, args.nodes + 1)]
            formed(cluster, nodes)
            for node in nodes:
                with cluster.client() as client:
                    took = put_back_after(client, node.name)
                print(node.name, "MISS" if took is None else f"{took * 1000:.1f} ms", flush=True)
        finally:
            cluster.close()


if __name__ == "__main__":
    main()
