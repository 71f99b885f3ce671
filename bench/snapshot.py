"""Benchmark: how much of a retained snapshot one control-plane read gets, and how fast.

    .venv/bin/python bench/snapshot.py
    .venv/bin/python bench/snapshot.py --records 250,1100,2100 --queue 1000,4096

For each Mosquitto queue limit (`max_queued_messages`; 1000 is Mosquitto's default, 4096
the shipped config's) and each number of retained workload records in one domain, a
fresh Mosquitto gets the records, then `imexd.control.link.Link` reads the domain's
workloads three times as a read-only command does (QoS 0) and as `workload create`'s
channel race does (QoS 1, `Link(race=True)`). Each line: the records the read got and the
median seconds of the three reads (connect, SUBACK, snapshot, sync echoes). A read that
got fewer records than there are is a partial snapshot: Mosquitto drops a QoS 1 snapshot
past 20 in flight plus the queue without a word.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiomqtt
from harness import Target, broker_target

from imexd.control.link import Link
from imexd.messages import WorkloadRecord, encode
from imexd.settings import BusSettings
from imexd.topics import Topics

TOPICS = Topics("imex/v2")
READS = 3


async def fill(broker: Target, records: int) -> None:
    async with aiomqtt.Client(*broker.endpoint) as client:
        for channel in range(1, records + 1):
            name = f"w{channel:05d}"
            record = WorkloadRecord(workload=name, domain="d1", channel=channel, generation=1)
            await client.publish(TOPICS.workload("d1", name), encode(record), qos=1, retain=True)


async def read(broker: Target, *, race: bool) -> tuple[int, float]:
    started = time.monotonic()
    async with Link(BusSettings(url=tuple(broker.urls)), race=race) as link:
        store = await link.read(link.topics.workloads_filter("d1"))
        return len(store.workloads), time.monotonic() - started


async def measure(records: int, queue: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        queued = f"max_queued_messages {queue}"
        broker = broker_target("mosquitto", Path(folder), extra_config=queued)
        broker.start()
        try:
            await fill(broker, records)
            for race in (False, True):
                results = [await read(broker, race=race) for _ in range(READS)]
                got = min(count for count, _ in results)
                seconds = statistics.median(s for _, s in results)
                qos = 1 if race else 0
                print(
                    f"queue {queue:5d}  records {records:5d}  QoS {qos}: got {got:5d} "
                    f"in {seconds:.2f} s"
                )
        finally:
            broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", default="250,1100,2100")
    parser.add_argument("--queue", default="1000,4096")
    args = parser.parse_args()
    for queue in (int(q) for q in args.queue.split(",")):
        for records in (int(r) for r in args.records.split(",")):
            asyncio.run(measure(records, queue))


if __name__ == "__main__":
    main()
