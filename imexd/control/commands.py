"""The control plane's commands: typed coroutines with plain arguments, one per action.

Each opens one `Link`, reads what it needs, writes, verifies, and says what it did on
`out` (results) and `err` (refusals, warnings); the return value is the exit code.
`imexd.cli.main` parses and checks the arguments (usage errors exit 2 before any of this
runs), loads the settings with `load_control_settings`, and runs the coroutine; a
`BusError` (broker unreachable, link lost) propagates to it and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, TextIO

import msgspec

from imexd import preflight
from imexd.channels.fleet import channel_conflicts, conflict_line
from imexd.control.link import Link, open_link
from imexd.control.store import Store, summarize
from imexd.errors import BusError
from imexd.health.fleet import (
    DomainState,
    DomainStatus,
    judge,
    render_list,
    render_status,
    status_json,
)
from imexd.messages import (
    Assignment,
    DomainSpec,
    MemberRecord,
    MemberState,
    Retry,
    WorkloadRecord,
    encode,
    reason_line,
)
from imexd.messages import now as wire_now
from imexd.order import next_generation
from imexd.settings import Settings, load_settings
from imexd.topics import WILDCARD, Topics

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

SEEN_WITHIN_S: Final = 600.0
"""`node assign --seen-within` default: an agent must have reported the node this recently."""
HEALTH_GRACE_S: Final = 2.0
"""After the members left, how long `delete` waits for their own health report clears
before it clears what is left itself (bounded by what is left of --timeout)."""
CONTROL_NAME: Final = "imexd-control"
"""Placeholder `[node] name` while loading settings: the control plane has no node, and a
host name that is not DNS-1123 must not make its settings invalid."""
CONTROL_ADDRESS: Final = "127.0.0.1"
"""Placeholder `[node] address` while loading settings: without one, loading them looks
up this host's interfaces (importing psutil), in every prolog command, for nothing."""


def load_control_settings(config: str | None, environ: Mapping[str, str] | None = None) -> Settings:
    """The same settings file and IMEXD_* environment as the agent's; only [bus], [domain]
    max_nodes and [health] report_interval_s matter here. A [bus] file (CA, certificate,
    key, password) that cannot be read is a ConfigError naming it."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("IMEXD_NODE_NAME", CONTROL_NAME)
    env.setdefault("IMEXD_NODE_ADDRESS", CONTROL_ADDRESS)
    settings = load_settings(config, environ=env)
    preflight.check(settings, programs=False)
    return settings


def next_spec(
    previous: DomainSpec | None,
    name: str,
    *,
    nodes: list[str] | None,
    max_nodes: int | None,
    default_max_nodes: int,
    after: int | None = None,
) -> DomainSpec:
    """The spec `domain create` writes: exactly the given node list, state active.

    The generation is one above `after`, the generation the broker serves on the spec's
    topic (a tombstone's included), or the Unix second where it serves nothing
    (`imexd.order.next_generation`). Without `--max-nodes` the previous spec's value is
    kept (changing it would make every member report NodeMapMismatch), else the
    `[domain] max_nodes` setting is used.
    """
    if max_nodes is None:
        max_nodes = previous.max_nodes if previous is not None else default_max_nodes
    if after is None and previous is not None:
        after = previous.generation
    return DomainSpec(
        domain=name,
        nodes=nodes,
        max_nodes=max_nodes,
        state="active",
        generation=next_generation(after),
        at=wire_now(),
    )


def deleted_workload(record: WorkloadRecord, *, after: int | None = None) -> WorkloadRecord:
    """A workload's tombstone: `deleted` on no node, one generation up (imexd.order).
    Agents remove its channel; a clear is never written, so no clear has to be trusted."""
    return msgspec.structs.replace(
        record,
        state="deleted",
        nodes=[],
        generation=next_generation(record.generation if after is None else after),
        at=wire_now(),
    )


def assignment(store: Store, topics: Topics, node: str, domain: str | None) -> bytes:
    """A node's assignment to `domain` (None: its tombstone, an assignment to no domain),
    one generation above what the broker serves on its topic."""
    after = store.generation(topics.assignment(node))
    return encode(Assignment(domain=domain, generation=next_generation(after), at=wire_now()))


def say_refused(refused: Sequence[str], err: TextIO) -> int:
    print(
        f"imexd: the broker did not keep our write to {', '.join(refused)} "
        "(refused by its ACL for the control plane's user, or written again since)",
        file=err,
    )
    return EXIT_FAILED


def _unseen(
    store: Store,
    nodes: Iterable[str],
    domain: str,
    command: str,
    err: TextIO,
    *,
    seen_within_s: float,
) -> int:
    """EXIT_USAGE after naming each node of `nodes` whose agent the bus says is gone
    (`Store.agent_down`: a clean stop, or its will, whatever `seen_within_s` says) or that
    no agent reported within `seen_within_s` seconds (presence record or health report; a
    live member record counts as seen), else EXIT_OK: a typo, or a node whose agent is not
    running, would leave the domain waiting for it (a Slurm prolog until its timeout)."""
    now = time.time()
    unseen: list[str] = []
    for node in nodes:
        down = store.agent_down(node, now=now)
        if down is not None:
            unseen.append(node)
            print(
                f"imexd {command}: node {node}: AgentDown: {down}; {domain} would wait for "
                "it forever. Start its agent, or give --force to use it anyway",
                file=err,
            )
            continue
        at, _ = store.last_seen(node)
        live = any(
            n == node and record.state is not MemberState.LOST
            for (_, _, n), record in store.members.items()
        )
        if live or (at is not None and now - at <= seen_within_s):
            continue
        when = "never" if at is None else f"last {now - at:.0f} s ago"
        unseen.append(node)
        print(
            f"imexd {command}: no agent reported node {node} within {seen_within_s:g} s "
            f"({when}): a typo, or a node without a running agent; {domain} would wait for "
            "it forever. Give --force to use it anyway",
            file=err,
        )
    return EXIT_USAGE if unseen else EXIT_OK


def _checked(t: Topics, nodes: Iterable[str]) -> list[str]:
    """What `_taken` and `_unseen` read of `nodes`, and only that, in one snapshot: the
    specs, the nodes' member records and reports in every domain, and their presences
    (`Link.read` would fetch the presences of the members it finds in a second round
    trip). A command for a few nodes pays nothing for the size of the fleet."""
    listed = list(nodes)
    return [
        t.specs_filter(),
        *(t.node_members_filter(WILDCARD, n) for n in listed),
        *(t.health(WILDCARD, n) for n in listed),
        *(t.presence(n) for n in listed),
    ]


def _taken(store: Store, nodes: Iterable[str], domain: str, command: str, err: TextIO) -> int:
    """EXIT_USAGE after naming each node of `nodes` that another live domain holds, else
    EXIT_OK. Moving such a node stops the IMEX daemon a running job there may use."""
    taken = {n: why for n in nodes if (why := store.elsewhere(n, domain))}
    for node, why in taken.items():
        print(
            f"imexd {command}: node {node} is in another domain: {'; '.join(why)}. Moving it "
            f"to {domain} stops its IMEX daemon there (a running job loses IMEX); give --steal "
            "to move it anyway",
            file=err,
        )
    return EXIT_USAGE if taken else EXIT_OK


async def create(
    settings: Settings,
    name: str,
    *,
    nodes: list[str] | None,
    max_nodes: int | None,
    out: TextIO,
    err: TextIO,
    steal: bool = False,
    force: bool = False,
    seen_within_s: float = SEEN_WITHIN_S,
) -> int:
    """Write the domain's spec, then the listed nodes' assignments (so that an assigned
    node already finds the spec, and its list position, when it joins).

    Refuses (EXIT_USAGE, writing nothing) when a listed node is in another live domain
    (`Store.elsewhere`), unless `steal`, and when a listed node was not reported by an
    agent within `seen_within_s` seconds (see `assign`), unless `force`: a Slurm prolog
    then fails at once, naming the node, instead of waiting for a domain that cannot
    form."""
    async with open_link(settings) as link:
        t = link.topics
        filters = [t.spec(name), *(t.assignment(n) for n in nodes or ())]
        if nodes:
            filters += _checked(t, nodes)
        store = await link.read(*filters)
        if not steal and _taken(store, nodes or (), name, "domain create", err):
            return EXIT_USAGE
        if not force and _unseen(
            store, nodes or (), name, "domain create", err, seen_within_s=seen_within_s
        ):
            return EXIT_USAGE
        previous = store.specs.get(name)
        before = {n: store.assignments.get(n) for n in nodes or ()}
        spec = next_spec(
            previous,
            name,
            nodes=nodes,
            max_nodes=max_nodes,
            default_max_nodes=settings.domain.max_nodes,
            after=store.generation(t.spec(name)),
        )
        if previous is not None and previous.max_nodes != spec.max_nodes:
            print(
                f"warning: max_nodes of {name} changes from {previous.max_nodes} to "
                f"{spec.max_nodes}: members configured otherwise report NodeMapMismatch",
                file=err,
            )
        written = {t.spec(name): encode(spec)}
        for node in nodes or ():
            written[t.assignment(node)] = assignment(store, t, node, name)
        for topic, payload in written.items():
            await link.put(topic, payload)
        refused = await link.verify(written)
    if refused:
        return say_refused(refused, err)
    verb = "created"
    if previous is not None:
        verb = "re-activated" if previous.state == "deleting" else "updated"
    listed = ",".join(spec.nodes) if spec.nodes is not None else "any node"
    print(
        f"domain {name}: {verb} (generation {spec.generation}, max_nodes {spec.max_nodes}, "
        f"nodes {listed})",
        file=out,
    )
    for node, was in before.items():
        note = f" (moved from {was})" if was not in (None, name) else ""
        print(f"node {node}: assigned to {name}{note}", file=out)
    return EXIT_OK


async def delete(settings: Settings, name: str, *, wait_s: float, out: TextIO, err: TextIO) -> int:
    """Set the spec to `deleting`, wait for the members to leave, then write the domain's
    tombstones: the spec `deleted`, each workload `deleted` (their channels go with the
    domain) and an assignment to no domain for each node assigned to it.

    Agents that see `deleting` clear their member record and health report, stop their
    daemon and remove their files. Once no member record of the domain is left, the
    tombstones follow (the spec's first, so that an assigned agent holds it before its
    assignment goes), then the health reports left by vanished nodes are cleared. A lost
    record (a crashed member's will) is not waited for: nobody is left to clear it, so
    the delete clears it with the rest (a node that comes back meanwhile sees `deleting`
    and leaves). Nothing of the control plane's is cleared: a deletion is a version
    (imexd.order), so that no agent that held the domain brings it back. Two cases keep
    the spec in state `deleting`, so that nodes still pointing at the domain stay out:

    - members still hold records at the timeout (exit 1): their assignments and the
      health reports of nodes without records are cleared all the same, but their records
      are kept (the node may still run a daemon); running delete again finishes the job;
    - members without an assignment to the domain were seen (static nodes: `[domain] name`
      in their settings), which would otherwise form the domain again (exit 0).
    """
    async with open_link(settings) as link:
        t = link.topics
        store = await link.read(
            t.spec(name),
            t.all_members_filter(name),
            t.health_filter(name),
            t.assignments_filter(),
            t.workloads_filter(name),
        )
        spec = store.specs.get(name)
        records = store.records_of(name)
        if (
            spec is None
            and not records
            and not store.assigned_to(name)
            and not store.reports_of(name)
            and not store.workloads_of(name)
        ):
            print(
                f"domain {name}: nothing to delete (no spec, records, reports, assignments or "
                "workloads)",
                file=out,
            )
            return EXIT_OK
        static = sorted({r.node for r in records} - set(store.assigned_to(name)))
        if spec is None or spec.state != "deleting":
            spec = DomainSpec(
                domain=name,
                nodes=spec.nodes if spec is not None else None,
                max_nodes=spec.max_nodes
                if spec is not None
                else records[0].max_nodes
                if records
                else settings.domain.max_nodes,
                state="deleting",
                generation=next_generation(store.generation(t.spec(name))),
                at=wire_now(),
            )
            await link.put(t.spec(name), encode(spec))
            refused = await link.verify({t.spec(name): encode(spec)})
            if refused:
                return say_refused(refused, err)
        members = sorted({r.node for r in records if r.state is not MemberState.LOST})
        lost = sorted({r.node for r in records} - set(members))
        print(
            f"domain {name}: deleting (generation {spec.generation}); waiting up to {wait_s:g} s "
            f"for {len(members)} member(s) to leave"
            + (f": {', '.join(members)}" if members else "")
            + (f"; clearing the lost record of {', '.join(lost)}" if lost else ""),
            file=out,
        )
        started = time.monotonic()
        await link.wait_until(lambda: not _standing(store, name), wait_s)
        left = sorted({r.node for r in _standing(store, name)})
        # Agents clear their health report right after their record: give those a moment.
        grace = min(HEALTH_GRACE_S, max(0.0, wait_s - (time.monotonic() - started)))
        await link.wait_until(
            lambda: not any(s.report.node in members for s in store.reports_of(name)), grace
        )
        written: dict[str, bytes] = {}
        keep_spec = bool(left or static)
        if not keep_spec:
            gone = msgspec.structs.replace(
                spec, state="deleted", generation=spec.generation + 1, at=wire_now()
            )
            written[t.spec(name)] = encode(gone)
        workloads = store.workloads_of(name)
        for workload in workloads:
            topic = t.workload(name, workload.workload)
            written[topic] = encode(deleted_workload(workload, after=store.generation(topic)))
        for node in store.assigned_to(name):
            written[t.assignment(node)] = assignment(store, t, node, None)
        written.update(
            {
                t.member(d, c, n): b""
                for (d, c, n), r in store.members.items()
                if d == name and r.state is MemberState.LOST and n not in left
            }
        )
        reports = [s.report for s in store.reports_of(name) if s.report.node not in left]
        for report in reports:
            written[t.health(name, report.node)] = b""
        for topic, payload in written.items():
            await link.put(topic, payload)
        refused = await link.verify(written)
        stuck = [_describe_member(store, name, node) for node in left]
    if refused:
        return say_refused(refused, err)
    assignments = sum(1 for topic in written if topic.endswith("/assignment"))
    cleared = f"{assignments} assignment(s), {len(reports)} leftover health report(s)"
    if workloads:
        cleared += f", {len(workloads)} workload(s): {', '.join(w.workload for w in workloads)}"
    if left:
        print(
            f"imexd: domain {name}: {len(left)} member(s) still hold records after {wait_s:g} s: "
            f"{'; '.join(stuck)}. Cleared {cleared}; the spec stays in state deleting so that "
            f"they leave when they come back. Run `imexd domain delete {name}` again to finish.",
            file=err,
        )
        return EXIT_FAILED
    if static:
        print(
            f"domain {name}: all members left; cleared {cleared}. The spec stays in state "
            f"deleting: {', '.join(static)} name this domain in their settings ([domain] name) "
            f"and would form it again without it. Change their settings, then run "
            f"`imexd domain delete {name}` again to delete the spec.",
            file=out,
        )
        return EXIT_OK
    print(f"domain {name}: deleted (spec generation {spec.generation + 1}, {cleared})", file=out)
    return EXIT_OK


def _standing(store: Store, domain: str) -> list[MemberRecord]:
    """The domain's member records but the lost ones (a crashed agent's will: nobody is
    left to clear it, so a delete does not wait for it)."""
    return [r for r in store.records_of(domain) if r.state is not MemberState.LOST]


def _describe_member(store: Store, domain: str, node: str) -> str:
    record = next((r for r in store.records_of(domain) if r.node == node), None)
    seen = store.reports.get((domain, node))
    parts = [node]
    if record is not None:
        parts.append(f"record {record.state.value}")
    if seen is not None:
        parts.append(f"last report {time.time() - seen.report.at:.0f} s ago")
        reason = reason_line(seen.report.conditions)
        if reason:
            parts.append(reason)
    return " (".join([parts[0], ", ".join(parts[1:]) + ")"]) if len(parts) > 1 else node


async def list_domains(settings: Settings, *, out: TextIO, err: TextIO) -> int:
    """Print every domain with a spec, records, reports or assignments; warn on stderr
    about each node a spec lists that is a live member of another domain (it stays out
    of the spec's domain: one IMEX daemon per node)."""
    async with open_link(settings) as link:
        t = link.topics
        store = await link.read(
            t.specs_filter(),
            t.all_members_filter("+"),
            t.health_filter("+"),
            t.assignments_filter(),
        )
    summaries = summarize(
        store, now=time.time(), report_interval_s=settings.health.report_interval_s
    )
    print(render_list(summaries), end="", file=out)
    for name, spec in sorted(store.specs.items()):
        if spec.state == "deleting":
            continue
        for node in spec.nodes or ():
            for other in _member_elsewhere(store, node, name):
                print(
                    f"warning: the spec of {name} lists {node}, a member of {other}: it "
                    f"stays out of {name} while it is in {other} (`imexd node assign {node} "
                    f"{name} --steal` moves it, stopping its IMEX daemon in {other})",
                    file=err,
                )
    return EXIT_OK


def _member_elsewhere(store: Store, node: str, domain: str) -> list[str]:
    """The other domains in which `node` holds a member record that is not lost."""
    return sorted(
        {
            d
            for (d, _, n), record in store.members.items()
            if n == node and d != domain and record.state is not MemberState.LOST
        }
    )


async def assign(
    settings: Settings,
    node: str,
    domain: str | None,
    *,
    out: TextIO,
    err: TextIO,
    steal: bool = False,
    force: bool = False,
    seen_within_s: float = SEEN_WITHIN_S,
) -> int:
    """Write a node's retained assignment (None: its tombstone, an assignment to no
    domain), one generation above what the broker serves (`assignment`).

    Assigning refuses (EXIT_USAGE, writing nothing) a node in another live domain unless
    `steal` (see `create`), and a node that no agent reported within `seen_within_s`
    seconds (presence record or health report; a member record counts as seen) unless
    `force`: a typo would otherwise create a phantom domain that never forms."""
    async with open_link(settings) as link:
        t = link.topics
        topic = t.assignment(node)
        filters = [topic, *([t.spec(domain)] if domain else [])]
        if domain is not None:
            filters += _checked(t, [node])
        store = await link.read(*filters)
        if domain is not None and not steal and _taken(store, [node], domain, "node assign", err):
            return EXIT_USAGE
        if (
            domain is not None
            and not force
            and _unseen(store, [node], domain, "node assign", err, seen_within_s=seen_within_s)
        ):
            return EXIT_USAGE
        before = store.assignments.get(node)
        spec = store.specs.get(domain) if domain else None
        payload = assignment(store, t, node, domain)
        await link.put(topic, payload)
        refused = await link.verify({topic: payload})
    if refused:
        return say_refused(refused, err)
    if domain is None:
        was = f"was {before}" if before else "it had no assignment"
        print(f"node {node}: unassigned ({was})", file=out)
        return EXIT_OK
    note = f" (moved from {before})" if before not in (None, domain) else ""
    print(f"node {node}: assigned to {domain}{note}", file=out)
    if spec is not None and spec.state == "deleting":
        print(f"warning: {domain} is being deleted: {node} leaves it at once", file=err)
    elif spec is not None and spec.nodes is not None and node not in spec.nodes:
        print(
            f"warning: the spec of {domain} lists only {', '.join(spec.nodes)}: {node} stays "
            f"out (NotInSpec) until `imexd domain create {domain} --nodes ...` lists it",
            file=err,
        )
    return EXIT_OK


async def forget(
    settings: Settings,
    node: str,
    *,
    out: TextIO,
    err: TextIO,
    force: bool = False,
    seen_within_s: float = SEEN_WITHIN_S,
) -> int:
    """Clear what a node gone for good left on the bus: its member records, health
    reports and presence record (not its assignment: that is `node unassign`).

    A lost record (its agent's will) is cleared; any other record means an agent may run
    as the node: refused (EXIT_USAGE, nothing written) while an agent reported the node
    within `seen_within_s`, even with `force` (clearing a running agent's record drops it
    from its peers' files); otherwise only with `force`."""
    async with open_link(settings) as link:
        t = link.topics
        store = await link.read(
            t.all_members_filter("+"),
            t.health_filter("+"),
            t.presence(node),
            t.assignment(node),
        )
        records = {
            t.member(d, c, n): r for (d, c, n), r in sorted(store.members.items()) if n == node
        }
        standing = [r for r in records.values() if r.state is not MemberState.LOST]
        at, _ = store.last_seen(node)
        now = time.time()
        age = None if at is None else now - at
        if standing:
            where = ", ".join(f"{r.state.value} record in {r.domain}" for r in standing)
            if age is not None and age <= seen_within_s:
                print(
                    f"imexd node forget: node {node} is live ({where}, reported {age:.0f} "
                    "s ago): its agent clears its records when it stops or leaves. Forgetting "
                    "a running agent's record would drop it from its peers' files; nothing "
                    "written",
                    file=err,
                )
                return EXIT_USAGE
            if not force:
                when = "never" if age is None else f"last {age:.0f} s ago"
                print(
                    f"imexd node forget: node {node} holds a {where} but was not reported "
                    f"within {seen_within_s:g} s ({when}). If its agent is gone for good, give "
                    "--force to clear it; nothing written",
                    file=err,
                )
                return EXIT_USAGE
        written = dict.fromkeys(records, b"")
        reports = [d for (d, n) in sorted(store.reports) if n == node]
        written.update((t.health(d, node), b"") for d in reports)
        presence = node in store.presences
        if presence:
            written[t.presence(node)] = b""
        if not written:
            print(f"node {node}: nothing to forget", file=out)
            return EXIT_OK
        for topic, payload in written.items():
            await link.put(topic, payload)
        refused = await link.verify(written)
        assigned = store.assignments.get(node)
    if refused:
        return say_refused(refused, err)
    parts = [f"the {r.state.value} member record in {r.domain}" for r in records.values()]
    parts.append(f"{len(reports)} health report(s)")
    if presence:
        parts.append("its presence")
    print(f"node {node}: forgot {', '.join(parts)}", file=out)
    if assigned is not None:
        print(
            f"node {node}: still assigned to {assigned}: an agent started as {node} joins it "
            f"again; `imexd node unassign {node}` clears that",
            file=out,
        )
    return EXIT_OK


async def retry(settings: Settings, node: str, *, wait_s: float, out: TextIO, err: TextIO) -> int:
    """Ask `node`'s agent to end its daemon's crash-loop wait and start it now (FATAL's
    10-minute cool-down, a BACKOFF delay), forgetting the failures counted so far; then
    wait up to `wait_s` for the node's report to say the daemon runs.

    The request goes to the domain the node's presence names; the agent acts on it once
    and never restarts a running daemon. Refused (EXIT_USAGE, nothing written): a node
    whose agent is down, that no agent reported, or that is in no domain. A daemon whose
    last report says RUNNING needs nothing (EXIT_OK, nothing written). When the command
    ends the request's tombstone (`done`, one generation up) replaces it; EXIT_FAILED when
    the daemon is not running by then.
    """
    async with open_link(settings) as link:
        t = link.topics
        store = await link.read(t.presence(node), t.all_members_filter("+"))
        presence = store.presences.get(node)
        down = store.agent_down(node, now=time.time())
        domain = None if presence is None else presence.domain
        if down is not None or domain is None:
            why = (
                f"{down}: retry once its agent runs again"
                if down is not None
                else "no agent reported it (no presence record): check the name"
                if presence is None
                else "it is in no domain, so it runs no daemon"
            )
            print(f"imexd node retry: node {node}: {why}; nothing written", file=err)
            return EXIT_USAGE
        topic = t.retry(domain, node)
        await link.read(t.health(domain, node), topic)

        def daemon() -> str:
            seen = store.reports.get((domain, node))
            return "" if seen is None else seen.report.daemon.state

        if daemon() == "RUNNING":
            print(f"node {node}: its daemon in {domain} is RUNNING: nothing to retry", file=out)
            return EXIT_OK
        asked = Retry(
            node=node,
            domain=domain,
            at=wire_now(),
            by=link.client_id,
            generation=next_generation(store.generation(topic)),
        )
        written = {topic: encode(asked)}
        await link.put(topic, written[topic])
        refused = await link.verify(written)
        if refused:
            return say_refused(refused, err)
        print(f"node {node}: asked its agent to start the daemon in {domain} now", file=out)
        running = await link.wait_until(lambda: daemon() == "RUNNING", wait_s)
        # Acted on, or too late: no request outlives the command.
        done = msgspec.structs.replace(
            asked, state="done", generation=asked.generation + 1, at=wire_now()
        )
        await link.put(topic, encode(done))
        seen = store.reports.get((domain, node))
    if running:
        print(f"node {node}: daemon RUNNING in {domain}", file=out)
        return EXIT_OK
    state = daemon() or "unknown (no report)"
    reason = "" if seen is None else reason_line(seen.report.conditions)
    print(
        f"imexd node retry: node {node}: daemon not RUNNING after {wait_s:g} s: {state}"
        + (f" ({reason})" if reason else ""),
        file=err,
    )
    return EXIT_FAILED


def _fingerprint(status: DomainStatus) -> bytes:
    """The judgement without what changes with every second (ages, the time)."""
    still = msgspec.structs.replace(
        status,
        at=0.0,
        nodes=[msgspec.structs.replace(r, age_s=None) for r in status.nodes],
    )
    return msgspec.json.encode(still)


async def _read_presences(link: Link, store: Store, name: str, nodes: Sequence[str] | None) -> None:
    """Read the presence of every node the judgement of domain `name` covers (`nodes`,
    else the spec's list, and every node with a member record of it), so that a member
    whose agent is gone reads AgentDown."""
    spec = store.specs.get(name)
    listed = nodes if nodes is not None else spec.nodes if spec is not None else None
    names = set(listed or ()) | {n for d, _, n in store.members if d == name}
    if names:
        await link.read(*(link.topics.presence(n) for n in sorted(names)))


async def status(
    settings: Settings,
    name: str,
    *,
    as_json: bool,
    wait: float,
    out: TextIO,
    err: TextIO,
    nodes: Sequence[str] | None = None,
) -> int:
    """Print the domain's state once: after the retained snapshot, wait up to `wait`
    seconds more for it to become UP (changes in flight), then print and exit 0 if UP.

    The domain is judged again after each message, and the wait ends on the one that
    made it UP: what is printed is that judgement (a Slurm prolog's `--wait` returns the
    moment the last member reported READY and connected, not at a later check).
    `nodes` (`--nodes`) are the members to judge, instead of the spec's list. Two active
    workloads of the domain on one channel (a ChannelConflict) are named on stderr and
    make the exit 1, UP or not."""
    interval = settings.health.report_interval_s
    async with open_link(settings) as link:
        t = link.topics
        store = await link.read(
            t.spec(name),
            t.all_members_filter(name),
            t.health_filter(name),
            t.workloads_filter(name),
        )
        await _read_presences(link, store, name, nodes)
        result = _judge_store(store, name, interval, nodes)
        told: tuple[object, ...] | None = None

        def tell() -> None:
            """While waiting, one stderr line per change of the judgement: a prolog's
            log shows what it waits for."""
            nonlocal told
            key = (result.state, result.ready, result.members, tuple(result.reasons[:1]))
            if key == told:
                return
            told = key
            why = f": {result.reasons[0]}" if result.reasons else ""
            until = "" if result.state == "UP" else f"; waiting up to {wait:g} s for UP"
            print(
                f"imexd domain status: {name} {result.state}, {result.ready} of "
                f"{result.members} members ready{why}{until}",
                file=err,
                flush=True,
            )

        def up() -> bool:
            nonlocal result
            result = _judge_store(store, name, interval, nodes)
            if told is not None:
                tell()
            return result.state == "UP"

        # Without a spec or --nodes no report makes the domain UP (NoSpec, NoMembers):
        # waiting would only delay the answer, and repeat its reason on stderr.
        if nodes is None and name not in store.specs:
            wait = 0.0
        if wait > 0 and result.state != "UP":
            tell()
        try:
            if wait > 0 and not await link.wait_until(up, wait):
                result = _judge_store(store, name, interval, nodes)  # as of the deadline
        except asyncio.CancelledError:  # Ctrl-C: the last judgement, then exit 130
            _print_status(result, as_json=as_json, out=out, nodes_given=nodes is not None)
            raise
    _print_status(result, as_json=as_json, out=out, nodes_given=nodes is not None)
    conflicts = channel_conflicts(store.workloads_of(name))
    for (domain, channel), names in conflicts.items():
        print(f"imexd domain status: {conflict_line(domain, channel, names)}", file=err)
    if not result.known:
        print(
            f"imexd: domain {name}: nothing on the bus (no spec, member record or health report)",
            file=err,
        )
        return EXIT_FAILED
    return EXIT_OK if result.state == "UP" and not conflicts else EXIT_FAILED


def _print_status(result: DomainStatus, *, as_json: bool, out: TextIO, nodes_given: bool) -> None:
    if as_json:
        print(status_json(result), file=out)
    elif result.known:
        print(render_status(result, nodes_given=nodes_given), end="", file=out)


def _judge_store(
    store: Store, name: str, report_interval_s: float, nodes: Sequence[str] | None = None
) -> DomainStatus:
    now = time.time()
    return judge(
        name,
        spec=store.specs.get(name),
        records=store.records_of(name),
        reports=store.reports_of(name),
        now=now,
        report_interval_s=report_interval_s,
        expect=nodes,
        down=store.agents_down(now=now),
    )


async def _event_or(event: asyncio.Event, stop: asyncio.Event, at_most_s: float) -> None:
    """Wait until `event` or `stop` is set, at most `at_most_s` seconds."""
    waiters = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())}
    try:
        await asyncio.wait(waiters, timeout=at_most_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def watch(
    settings: Settings,
    name: str,
    *,
    as_json: bool,
    stop: asyncio.Event,
    out: TextIO,
    err: TextIO,
    retry_s: float = 2.0,
    nodes: Sequence[str] | None = None,
) -> int:
    """Redraw the status on every change (and as reports age) until `stop`.

    On a terminal the screen is redrawn; otherwise each new table follows the previous
    one (with --json: one JSON document per line). A lost link is reconnected; a broker
    unreachable at the start is an error. The exit status is that of the last state.
    """
    interval = settings.health.report_interval_s
    tty = out.isatty()
    last: bytes | None = None
    state: DomainState | None = None
    connected_once = False
    while not stop.is_set():
        try:
            async with open_link(settings) as link:
                t = link.topics
                store = await link.read(
                    t.spec(name), t.all_members_filter(name), t.health_filter(name)
                )
                await _read_presences(link, store, name, nodes)
                connected_once = True
                while not stop.is_set():
                    link.changed.clear()
                    result = _judge_store(store, name, interval, nodes)
                    key = _fingerprint(result)
                    if key != last:
                        last, state = key, result.state
                        _draw(
                            result, as_json=as_json, tty=tty, out=out, nodes_given=nodes is not None
                        )
                    await _event_or(link.changed, stop, 1.0)
                    link.raise_if_lost()
        except BusError as exc:
            if not connected_once:
                raise
            print(f"imexd: {exc}; reconnecting", file=err, flush=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(retry_s):
                    await stop.wait()
    return EXIT_OK if state == "UP" else EXIT_FAILED


def _draw(
    result: DomainStatus, *, as_json: bool, tty: bool, out: TextIO, nodes_given: bool
) -> None:
    if as_json:
        out.write(status_json(result) + "\n")
    elif tty:
        table = render_status(result, nodes_given=nodes_given)
        out.write("\x1b[H\x1b[2J" + table + "(watching; Ctrl-C to stop)\n")
    else:
        out.write(render_status(result, nodes_given=nodes_given) + "\n")
    out.flush()
