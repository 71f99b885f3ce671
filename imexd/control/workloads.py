"""The control plane's workloads: `imexd workload create|delete|list|status|env`.

A workload is a named user of a domain's IMEX, isolated from the domain's other workloads
by its own IMEX channel. The control plane writes one retained `WorkloadRecord` per
workload on `{p}/domains/{d}/workloads/{w}`; the agents of the nodes it lists make the
channel's device node (plus a CDI spec and an env file) and report it in their
HealthReport's `channels`, which `imexd.channels.fleet.judge_workload` judges.

Channels are unique within a domain. Allocation (`create` without `--channel`) takes the
lowest channel from 1 that no other workload of the domain holds, below the smallest
`channels.count` the domain's nodes report (2048 when none is known); channel 0 is only
ever given on request (`--channel 0`), since the driver may create it world-usable.

Two control-plane clients creating at once must never give one channel to two workloads.
Each client subscribes to the domain's workloads, picks a channel from what it saw, and
publishes its record in state `claiming` (agents ignore such records). It then waits for
the echo of that publish on its own subscription: any other workload's record on the same
channel that arrived before the echo (and was not cleared before it) wins, ours loses;
records arriving after the echo lose to ours. This relies on one broker delivering every
subscriber the same order of publishes (Mosquitto does: it forwards each publish to all
subscribers as it processes it). A bridged or clustered broker that could reorder
publishes from two clients breaks the rule: point every control plane at one broker. A
loser writes its claim's tombstone and picks again, a bounded number of times; the winner
publishes its record `active`, and `Link.verify` shows that no second client has since
written the same workload name. A stale claim left by a client that died keeps its
channel taken until `workload delete` writes its tombstone.

Exit codes: 0 success, 1 failure (not ready by the deadline, no such workload, a bus
error), 2 usage errors (see the CLI), 3 no free channel.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable, Sequence
from typing import Final, TextIO

import msgspec

from imexd.channels.fleet import (
    WorkloadStatus,
    channel_conflicts,
    conflict_line,
    judge_workload,
    render_workload_list,
    render_workload_status,
    report_state,
    workload_list_json,
    workload_status_json,
)
from imexd.control.commands import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    deleted_workload,
    say_refused,
)
from imexd.control.link import Link, Logged, open_link
from imexd.control.store import Store
from imexd.health.fleet import SeenReport
from imexd.messages import CHANNELS_READY, ChannelsView, HealthReport, WorkloadRecord, encode
from imexd.messages import now as wire_now
from imexd.order import next_generation
from imexd.settings import Settings

EXIT_NO_CHANNEL: Final = 3
DEFAULT_CHANNEL_COUNT: Final = 2048
"""Channels assumed when no node of the domain reports its driver's ImexChannelCount
(the driver's default)."""
CLAIM_ATTEMPTS: Final = 16
"""Claims a client may lose to rivals before it gives up (each loss means some rival won
a channel, so rivals that start together finish within as many rounds as they are)."""
CLAIM_BACKOFF_S: Final = 0.05
"""Upper bound of the random pause after a lost claim, so two losers do not pick again
in lockstep."""
DEFAULT_UID: Final = 0
DEFAULT_GID: Final = 0
DEFAULT_MODE: Final = 0o660
CHANNEL_DEVICE_DIR: Final = "/dev/nvidia-caps-imex-channels"
"""Where a job finds the channel's device node (on the host, and in a container by CDI)."""


# Pure parts: what is free, who won.


def channel_count(
    reports: Iterable[SeenReport], *, now: float, report_interval_s: float
) -> int | None:
    """The smallest `channels.count` among the fresh reports (None: none reports one)."""
    counts = [
        s.report.channels.count
        for s in reports
        if s.report.channels is not None
        and s.report.channels.count is not None
        and report_state(s, now=now, report_interval_s=report_interval_s) == "fresh"
    ]
    return min(counts) if counts else None


def used_channels(records: Iterable[WorkloadRecord], workload: str) -> dict[int, str]:
    """Channel -> the other workload holding it (claiming or active), `workload` aside."""
    return {r.channel: r.workload for r in records if r.workload != workload}


def lowest_free(used: Iterable[int], count: int) -> int | None:
    """The lowest channel in 1..count-1 not in `used`; None when all are."""
    taken = set(used)
    return next((c for c in range(1, count) if c not in taken), None)


def first_rival(
    log: Sequence[Logged], *, domain: str, workload: str, channel: int
) -> WorkloadRecord | None:
    """Another workload of `domain` holding `channel` after the messages of `log`.

    `log` is what arrived before our claim's echo; a record there that is still standing
    (not cleared or moved since) was published before ours, so it wins the channel.
    """
    standing: dict[str, WorkloadRecord] = {}
    for logged in log:
        if logged.record is None:
            standing.pop(logged.topic, None)
        else:
            standing[logged.topic] = logged.record
    return next(
        (
            r
            for r in standing.values()
            if r.domain == domain and r.workload != workload and r.channel == channel
        ),
        None,
    )


def env_lines(record: WorkloadRecord) -> list[str]:
    """`workload env`: the shell lines that hand the channel to a job."""
    return [
        f"export IMEX_CHANNEL={record.channel}",
        f"export IMEXD_WORKLOAD={record.workload}",
        f"export IMEXD_DOMAIN={record.domain}",
        f"export IMEXD_CHANNEL_DEVICE={CHANNEL_DEVICE_DIR}/channel{record.channel}",
    ]


def _status_of(store: Store, record: WorkloadRecord, report_interval_s: float) -> WorkloadStatus:
    now = time.time()
    return judge_workload(
        record,
        reports=store.reports_of(record.domain),
        members=store.records_of(record.domain),
        now=now,
        report_interval_s=report_interval_s,
        workloads=store.workloads_of(record.domain),
        down=store.agents_down(now=now),
    )


def _not_ready(status: WorkloadStatus) -> str:
    """Which nodes lack the channel, and why, on one line."""
    why = [
        f"{r.node}: {r.reason} ({r.message})" if r.message else f"{r.node}: {r.reason}"
        for r in status.nodes
        if not r.ready
    ]
    return "; ".join(why) or "; ".join(status.reasons)


# Commands.


async def create(
    settings: Settings,
    name: str,
    *,
    domain: str,
    nodes: list[str] | None,
    channel: int | None,
    uid: int | None,
    gid: int | None,
    mode: int | None,
    wait_s: float,
    as_json: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    """Create (or update) workload `name` of `domain`, then wait for its nodes.

    The command states the whole record: nodes (default: the spec's list, else every node
    of the domain), uid, gid and mode (defaults 0, 0, 0660). An existing active workload
    keeps its channel (a different `channel` is a usage error) and gets generation + 1;
    a new one claims a channel (module docstring). Then up to `wait_s` seconds for every
    listed node to report the channel ready for this generation.
    """
    interval = settings.health.report_interval_s
    command = "imexd workload create"
    async with open_link(settings, race=True) as link:
        t = link.topics
        topic = t.workload(domain, name)
        filters = [t.workloads_filter(domain), t.spec(domain), t.health_filter(domain)]
        if nodes is None:
            filters.append(t.all_members_filter(domain))
        else:
            # The listed nodes' member records and presences (whether their agents live)
            # in the same snapshot: no second round trip for the presences (`Link.read`).
            filters += [t.node_members_filter(domain, n) for n in nodes]
            filters += [t.presence(n) for n in nodes]
        store = await link.read(*filters)
        spec = store.specs.get(domain)
        if spec is not None and spec.state == "deleting":
            print(f"{command}: domain {domain} is being deleted", file=err)
            return EXIT_USAGE
        if t.spec(domain) in store.tombstones:
            print(f"{command}: domain {domain} is deleted", file=err)
            return EXIT_USAGE
        if nodes is None and spec is not None:
            nodes = spec.nodes
        # Without a list the workload is every member's: each must have a live agent too.
        judged = nodes or sorted({n for d, _, n in store.members if d == domain})
        if judged:
            await link.read(*(t.presence(n) for n in judged))  # AgentDown
        now = time.time()
        down = {n: why for n in judged if (why := store.agent_down(n, now=now))}
        for node, why in down.items():
            print(
                f"{command}: node {node}: AgentDown: {why}; workload {name} would wait for "
                "it forever. Start its agent, or leave the node out (--nodes)",
                file=err,
            )
        if down:
            return EXIT_USAGE
        previous = store.workloads.get((domain, name))
        kept = previous if previous is not None and previous.state == "active" else None
        known = channel_count(store.reports_of(domain), now=time.time(), report_interval_s=interval)
        count = known if known is not None else DEFAULT_CHANNEL_COUNT
        if kept is not None and channel is not None and channel != kept.channel:
            print(
                f"{command}: workload {name} of {domain} exists on channel {kept.channel}, not "
                f"{channel}: delete it first to move it to another channel",
                file=err,
            )
            return EXIT_USAGE
        conflicts = channel_conflicts(store.workloads_of(domain))
        rivals = conflicts.get((domain, kept.channel), []) if kept is not None else []
        if kept is not None and len(rivals) > 1:
            others = ", ".join(r for r in rivals if r != name)
            print(
                f"{command}: channel {kept.channel} of {domain} is also claimed by workload "
                f"{others} (a ChannelConflict: agents give it to the one that held it first): "
                "delete the one that should not be there before writing either again",
                file=err,
            )
            return EXIT_USAGE
        if kept is None and channel is not None and known is not None and channel >= known:
            print(
                f"{command}: --channel {channel} is out of range: the nodes of {domain} offer "
                f"{known} channels (0 to {known - 1})",
                file=err,
            )
            return EXIT_USAGE
        base = WorkloadRecord(
            workload=name,
            domain=domain,
            channel=kept.channel if kept is not None else (channel or 0),
            nodes=list(nodes) if nodes is not None else None,
            uid=DEFAULT_UID if uid is None else uid,
            gid=DEFAULT_GID if gid is None else gid,
            mode=DEFAULT_MODE if mode is None else mode,
            state="active",
            generation=next_generation(store.generation(topic)),
            owner=link.client_id,
            created=previous.created if previous is not None else round(time.time(), 3),
            at=wire_now(),
        )
        if kept is None:
            claimed = await _claim(link, base, explicit=channel is not None, count=count, err=err)
            if isinstance(claimed, int):
                return claimed
            base = claimed
        payload = encode(base)
        await link.put(topic, payload)
        refused = await link.verify({topic: payload})
        if refused:
            return say_refused(refused, err)
        verb = "updated" if kept is not None else "created"
        print(
            f"workload {name} in {domain}: {verb} on channel {base.channel} (generation "
            f"{base.generation}, nodes {_nodes_text(base)}, uid {base.uid}, gid {base.gid}, "
            f"mode {base.mode:04o})",
            file=err if as_json else out,  # with --json, stdout is one JSON document
        )
        result = _status_of(store, base, interval)

        def ready() -> bool:
            nonlocal result
            result = _status_of(store, base, interval)
            return result.state == "READY"

        if wait_s > 0 and not await link.wait_until(ready, wait_s):
            result = _status_of(store, base, interval)  # as of the deadline
    if as_json:
        print(workload_status_json(result), file=out)
    elif wait_s > 0:
        print(render_workload_status(result), end="", file=out)
    if wait_s > 0 and result.state != "READY":
        print(
            f"imexd: workload {name} in {domain}: not ready after {wait_s:g} s (the record is "
            f"kept): {_not_ready(result)}",
            file=err,
        )
        return EXIT_FAILED
    return EXIT_OK


def _nodes_text(record: WorkloadRecord) -> str:
    return ",".join(record.nodes) if record.nodes is not None else "every node of the domain"


async def _claim(
    link: Link, base: WorkloadRecord, *, explicit: bool, count: int, err: TextIO
) -> WorkloadRecord | int:
    """Win a channel for `base` against concurrent clients (module docstring): the record
    to publish active, or the exit code."""
    command = "imexd workload create"
    domain, name = base.domain, base.workload
    topic = link.topics.workload(domain, name)
    generation = base.generation  # the claim's; the record it becomes is one up
    for _ in range(CLAIM_ATTEMPTS):
        used = used_channels(link.store.workloads_of(domain), name)
        if explicit:
            chosen = base.channel
            holder = used.get(chosen)
            if holder is not None:
                print(
                    f"{command}: channel {base.channel} of {domain} is used by workload {holder}",
                    file=err,
                )
                return EXIT_USAGE
        else:
            free = lowest_free(used, count)
            if free is None:
                busy = sum(1 for c in used if 1 <= c < count)
                print(
                    f"{command}: no free channel in {domain}: its nodes offer {count} channels "
                    f"(1 to {count - 1} for workloads, 0 only with --channel 0) and {busy} are "
                    "used; delete a workload, or raise the driver's ImexChannelCount",
                    file=err,
                )
                return EXIT_NO_CHANNEL
            chosen = free
        claim = msgspec.structs.replace(
            base, channel=chosen, state="claiming", generation=generation
        )
        echo = await link.put_echoed(topic, encode(claim))
        rival = first_rival(link.workload_log[:echo], domain=domain, workload=name, channel=chosen)
        if rival is None:
            return msgspec.structs.replace(
                claim, state="active", generation=generation + 1, at=wire_now()
            )
        given_up = deleted_workload(claim, after=generation)
        generation = given_up.generation + 1
        await link.put(topic, encode(given_up))
        if explicit:
            print(
                f"{command}: channel {chosen} of {domain} was claimed by workload "
                f"{rival.workload} just before us",
                file=err,
            )
            return EXIT_USAGE
        await asyncio.sleep(random.uniform(0.0, CLAIM_BACKOFF_S))  # noqa: S311 - not crypto
    print(
        f"imexd: workload {name} in {domain}: other clients won the channel {CLAIM_ATTEMPTS} "
        "times in a row; try again",
        file=err,
    )
    return EXIT_FAILED


async def _locate(
    link: Link, name: str, domain: str | None, command: str, err: TextIO
) -> str | int:
    """The domain of workload `name` (given, or the one domain that has it), with the
    workloads read; else the exit code (1: none, 2: several and no --domain)."""
    t = link.topics
    store = await link.read(t.workloads_filter(domain or "+"))
    if domain is not None:
        if (domain, name) in store.workloads:
            return domain
        print(f"imexd {command}: no workload {name} in domain {domain}", file=err)
        return EXIT_FAILED
    domains = sorted(d for d, w in store.workloads if w == name)
    if not domains:
        print(f"imexd {command}: no workload {name} in any domain", file=err)
        return EXIT_FAILED
    if len(domains) > 1:
        print(
            f"imexd {command}: workload {name} exists in domains {', '.join(domains)}: "
            "give --domain",
            file=err,
        )
        return EXIT_USAGE
    return domains[0]


async def delete(
    settings: Settings,
    name: str,
    *,
    domain: str | None,
    wait_s: float,
    out: TextIO,
    err: TextIO,
) -> int:
    """Write the workload's tombstone (`deleted_workload`, one generation up), then wait up
    to `wait_s` seconds until no node of the domain reports the workload any more (its
    agents removed the channel)."""
    interval = settings.health.report_interval_s
    async with open_link(settings) as link:
        found = await _locate(link, name, domain, "workload delete", err)
        if isinstance(found, int):
            return found
        t = link.topics
        store = await link.read(t.health_filter(found))
        record = store.workloads[(found, name)]
        topic = t.workload(found, name)
        gone = encode(deleted_workload(record, after=store.generation(topic)))
        await link.put(topic, gone)
        refused = await link.verify({topic: gone})
        if refused:
            return say_refused(refused, err)

        def holders() -> tuple[list[str], list[str]]:
            """(the nodes whose fresh report lists the workload, those whose fresh report
            cannot say: channels not shown yet, or workloads omitted to fit)."""
            now = time.time()
            listing, unsure = [], []
            for seen in store.reports_of(found):
                view = seen.report.channels
                if (
                    view is None
                    or report_state(seen, now=now, report_interval_s=interval) != "fresh"
                ):
                    continue
                if any(i.workload == name for i in view.workloads):
                    listing.append(seen.report.node)
                elif _channels_pending(seen.report) or _may_be_omitted(name, view):
                    unsure.append(seen.report.node)
            return sorted(listing), sorted(unsure)

        print(f"workload {name} in {found}: deleted (channel {record.channel} freed)", file=out)
        await link.wait_until(lambda: holders() == ([], []), wait_s)
        listing, unsure = holders()
    if (listing or unsure) and wait_s > 0:
        said = []
        if listing:
            said.append(
                f"still listed after {wait_s:g} s by {', '.join(listing)} (their agents have "
                "not removed the channel yet)"
            )
        for node in unsure:
            said.append(f"{node} has not shown its channels yet (its agent may hold the channel)")
        print(f"imexd: workload {name} in {found}: {'; '.join(said)}", file=err)
        return EXIT_FAILED
    return EXIT_OK


def _may_be_omitted(name: str, view: ChannelsView) -> bool:
    """Whether workload `name` may be among those the report left out to fit its payload
    (the last ones by name)."""
    return view.omitted > 0 and (not view.workloads or name > view.workloads[-1].workload)


def _channels_pending(report: HealthReport) -> bool:
    """Whether the node's channels are not shown yet (ChannelsReady Unknown: a new agent
    before its first apply lists no workload, whatever its devices are)."""
    return any(c.type == CHANNELS_READY and c.status == "Unknown" for c in report.conditions)


async def list_workloads(
    settings: Settings, *, domain: str | None, as_json: bool, out: TextIO, err: TextIO
) -> int:
    """Print every workload (of `domain`, or of every domain) with its readiness; exit 1
    when two active workloads of a domain claim one channel (each named on stderr)."""
    interval = settings.health.report_interval_s
    scope = domain or "+"
    async with open_link(settings) as link:
        t = link.topics
        store = await link.read(
            t.workloads_filter(scope), t.all_members_filter(scope), t.health_filter(scope)
        )
    statuses = [
        _status_of(store, record, interval) for _, record in sorted(store.workloads.items())
    ]
    if as_json:
        print(workload_list_json(statuses), file=out)
    else:
        print(render_workload_list(statuses), end="", file=out)
    conflicts = channel_conflicts(store.workloads.values())
    for (name, channel), names in conflicts.items():
        print(f"imexd workload list: {conflict_line(name, channel, names)}", file=err)
    return EXIT_FAILED if conflicts else EXIT_OK


async def status(
    settings: Settings,
    name: str,
    *,
    domain: str | None,
    wait_s: float,
    as_json: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    """Print the workload's channel on each listed node once every node is ready, or at
    the end of `wait_s` seconds; exit 0 only when every listed node is ready."""
    interval = settings.health.report_interval_s
    async with open_link(settings) as link:
        found = await _locate(link, name, domain, "workload status", err)
        if isinstance(found, int):
            return found
        t = link.topics
        store = await link.read(t.all_members_filter(found), t.health_filter(found))
        record = store.workloads[(found, name)]
        listed = record.nodes or sorted({n for d, _, n in store.members if d == found})
        if listed:
            await link.read(*(t.presence(n) for n in listed))  # AgentDown

        def judged() -> WorkloadStatus:
            return _status_of(store, store.workloads.get((found, name), record), interval)

        result = judged()

        def ready() -> bool:
            nonlocal result
            result = judged()
            return result.state == "READY"

        if not await link.wait_until(ready, wait_s):
            result = judged()  # as of the deadline
    if as_json:
        print(workload_status_json(result), file=out)
    else:
        print(render_workload_status(result), end="", file=out)
    return EXIT_OK if result.state == "READY" else EXIT_FAILED


async def env(
    settings: Settings, name: str, *, domain: str | None, out: TextIO, err: TextIO
) -> int:
    """Print the `export` lines of a workload whose channel is ready on every node it
    lists (for a Slurm TaskProlog); exit 1 with the reason, and no line, otherwise: a
    job handed a device path that no node has would fail later, and further from why."""
    interval = settings.health.report_interval_s
    async with open_link(settings) as link:
        found = await _locate(link, name, domain, "workload env", err)
        if isinstance(found, int):
            return found
        record = link.store.workloads[(found, name)]
        if record.state != "active":
            print(
                f"imexd workload env: workload {name} in {found} is not active (state "
                f"{record.state}: its channel is still being claimed)",
                file=err,
            )
            return EXIT_FAILED
        t = link.topics
        store = await link.read(t.all_members_filter(found), t.health_filter(found))
        listed = record.nodes or sorted({n for d, _, n in store.members if d == found})
        if listed:
            await link.read(*(t.presence(n) for n in listed))  # AgentDown
        result = _status_of(store, store.workloads.get((found, name), record), interval)
    if result.state != "READY":
        print(
            f"imexd workload env: workload {name} in {found} is not ready ({result.state}, "
            f"{result.ready} of {result.listed} nodes): {_not_ready(result)}; see "
            f"`imexd workload status {name}`",
            file=err,
        )
        return EXIT_FAILED
    for line in env_lines(result.record):
        print(line, file=out)
    return EXIT_OK
