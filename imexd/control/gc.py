"""`imexd gc`: the domains and workloads that failed Slurm epilogs left on the bus.

The shipped Slurm prologs (config/slurm/) name a per-job domain and a shared-layout
workload `job-<SLURM_JOB_ID>`; an epilog that failed leaves them retained. `gc` selects
candidates with the selectors given (each given one must select a record):

- `live_jobs`: a domain or workload named `job-<id>` whose id is not a live job, nor above
  every live id (Slurm counts ids up: such a job may have started after the list was
  taken, so only an empty list, no job running, leaves no such bound);
- `older_than_s`: a workload created (`WorkloadRecord.created`) more than that long ago.
  A DomainSpec carries no creation time, so age neither selects nor spares a domain: with
  `older_than_s` alone no domain is selected;
- `tombstones_s`: a tombstone (a spec or workload `deleted`, an assignment to no domain,
  imexd.order) written more than that long ago (its `at`), which `--apply` clears. The
  broker drops them by itself after `[control] tombstone_expiry_s` (MQTT 5 message
  expiry), and agents stop giving them back then; this clears them sooner, or on a broker
  without message expiry. An agent that still holds one gives it back (its expiry not
  reached): clear with an age above the agents' `tombstone_expiry_s`.

In use, and so kept (with the reason), is a workload selected by age alone (no job list)
whose channel a node reports ready (`judge_workload`'s rows): a job may hold it, and age
says nothing about that. With a job list, the list is the judge: the record of a job that
is not running is not in use, whether or not its daemons still run; stopping them is what
`gc` is for. A record of a live job is never selected.

Without `apply` it only prints the candidates. With it, each one that is not kept goes
through the commands' own deletes, `workloads.delete` first and then `commands.delete`
(which clears a domain's remaining workloads too): gc deletes exactly as an operator's
`imexd workload delete` and `imexd domain delete` would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TextIO

from imexd.channels.fleet import judge_workload
from imexd.control import commands, workloads
from imexd.control.commands import EXIT_FAILED, EXIT_OK
from imexd.control.link import Link, open_link
from imexd.control.store import Store
from imexd.health.fleet import seconds_text, table
from imexd.messages import WorkloadRecord
from imexd.names import job_of
from imexd.settings import Settings


@dataclass(frozen=True, slots=True)
class Candidate:
    """One record `gc` selected: what it is, why, and why it is kept (if it is)."""

    kind: Literal["domain", "workload"]
    domain: str
    workload: str | None
    why: str
    kept: str | None = None
    """Why it is in use and not deleted; None: `--apply` deletes it."""


def _job_why(name: str, live_jobs: frozenset[int]) -> str | None:
    """Why `name` is a dead job's (None: it is not): named `job-<id>`, the id not live and
    not above every live id (Slurm counts ids up, so such a job may have started after
    the list was taken, its prolog creating its records since)."""
    job = job_of(name)
    if job is None or job in live_jobs or (live_jobs and job > max(live_jobs)):
        return None
    return f"job {job} is not in --live-jobs"


def _in_use(
    store: Store, record: WorkloadRecord, *, now: float, report_interval_s: float
) -> str | None:
    """Why a workload is in use: the nodes that report its channel ready (None: none do)."""
    status = judge_workload(
        record,
        reports=store.reports_of(record.domain),
        members=store.records_of(record.domain),
        now=now,
        report_interval_s=report_interval_s,
        down=store.agents_down(now=now),
    )
    ready = [row.node for row in status.nodes if row.ready]
    return f"in use: its channel is ready on {', '.join(ready)}" if ready else None


def select(
    store: Store,
    *,
    live_jobs: frozenset[int] | None,
    older_than_s: float | None,
    now: float,
    report_interval_s: float,
) -> list[Candidate]:
    """The candidates in `store` (module docstring): workloads first, then domains."""
    found: list[Candidate] = []
    for (domain, name), record in sorted(store.workloads.items()):
        why: list[str] = []
        if live_jobs is not None:
            if (job := _job_why(name, live_jobs)) is None:
                continue
            why.append(job)
        if older_than_s is not None:
            age = now - record.created
            if record.created <= 0 or age <= older_than_s:
                continue
            why.append(f"created {seconds_text(age)} s ago")
        kept = None
        if live_jobs is None:
            kept = _in_use(store, record, now=now, report_interval_s=report_interval_s)
        found.append(Candidate("workload", domain, name, "; ".join(why), kept))
    if live_jobs is not None:
        domains = set(store.domains()) | {d for d, _ in store.workloads}
        for domain in sorted(domains):
            if (job := _job_why(domain, live_jobs)) is not None:
                found.append(Candidate("domain", domain, None, job))
    return found


def render(found: Sequence[Candidate]) -> str:
    """The candidates as a table: KIND DOMAIN WORKLOAD WHY ACTION."""
    rows = [
        [c.kind, c.domain, c.workload or "-", c.why, "keep" if c.kept else "delete"] for c in found
    ]
    return "\n".join(table(["KIND", "DOMAIN", "WORKLOAD", "WHY", "ACTION"], rows)) + "\n"


def old_tombstones(store: Store, older_than_s: float, *, now: float) -> list[str]:
    """The topics of the tombstones in `store` written more than `older_than_s` ago."""
    return sorted(
        topic for topic, t in store.tombstones.items() if t.at > 0 and now - t.at > older_than_s
    )


async def _tombstones(
    link: Link, store: Store, older_than_s: float, *, apply: bool, out: TextIO, err: TextIO
) -> int:
    """List (and with `apply`, clear) the tombstones older than `older_than_s`."""
    found = old_tombstones(store, older_than_s, now=time.time())
    for topic in found:
        print(f"tombstone {topic}", file=out)
    if not found or not apply:
        verb = "would clear" if found else "no tombstone to clear"
        print(f"{verb} {len(found)} tombstone(s)" if found else verb, file=out)
        return EXIT_OK
    written = dict.fromkeys(found, b"")
    for topic in found:
        await link.put(topic, b"")
    refused = await link.verify(written)
    if refused:
        return commands.say_refused(refused, err)
    print(f"gc: cleared {len(found)} tombstone(s)", file=out)
    return EXIT_OK


def _label(c: Candidate) -> str:
    return f"workload {c.workload} in {c.domain}" if c.workload else f"domain {c.domain}"


async def _read(link: Link, *, presences: bool) -> Store:
    """Every spec, workload, member record, health report and assignment; with `presences`
    (for the in-use judgement), the presence of every node they name, so that a gone
    agent reads AgentDown."""
    t = link.topics
    store = await link.read(
        t.specs_filter(),
        t.workloads_filter("+"),
        t.all_members_filter("+"),
        t.health_filter("+"),
        t.assignments_filter(),
    )
    nodes = {n for _, _, n in store.members} | {n for _, n in store.reports}
    nodes.update(n for w in store.workloads.values() for n in w.nodes or ())
    if presences and nodes:
        await link.read(*(t.presence(n) for n in sorted(nodes)))
    return store


async def gc(
    settings: Settings,
    *,
    live_jobs: frozenset[int] | None,
    older_than_s: float | None,
    apply: bool,
    wait_s: float,
    out: TextIO,
    err: TextIO,
    tombstones_s: float | None = None,
) -> int:
    """Print the candidates; with `apply`, delete those not kept, each through its own
    command's delete with `wait_s`, and clear the old tombstones. EXIT_FAILED when one of
    those failed."""
    if live_jobs is None and older_than_s is None and tombstones_s is None:
        raise ValueError("gc needs a selector: it must never select everything")
    async with open_link(settings) as link:
        store = await _read(link, presences=live_jobs is None)
        if tombstones_s is not None:
            code = await _tombstones(link, store, tombstones_s, apply=apply, out=out, err=err)
            if code != EXIT_OK or (live_jobs is None and older_than_s is None):
                return code
    found = select(
        store,
        live_jobs=live_jobs,
        older_than_s=older_than_s,
        now=time.time(),
        report_interval_s=settings.health.report_interval_s,
    )
    if live_jobs is not None and not live_jobs:
        print("note: --live-jobs is empty: every job-<id> record is a candidate", file=out)
    if older_than_s is not None:
        print(
            "note: --older-than applies to workloads only (a DomainSpec carries no creation time)",
            file=out,
        )
    if not found:
        print("nothing to collect", file=out)
        return EXIT_OK
    print(render(found), end="", file=out)
    doomed = [c for c in found if c.kept is None]
    if not apply:
        print(
            f"dry run: nothing changed; run again with --apply to delete {len(doomed)} of "
            f"{len(found)}",
            file=out,
        )
        return EXIT_OK
    failed: list[str] = []
    for c in found:
        if c.kept is not None:
            print(f"kept {_label(c)}: {c.kept}", file=out)
            continue
        if c.workload is not None:
            code = await workloads.delete(
                settings, c.workload, domain=c.domain, wait_s=wait_s, out=out, err=err
            )
        else:
            code = await commands.delete(settings, c.domain, wait_s=wait_s, out=out, err=err)
        if code != EXIT_OK:
            failed.append(_label(c))
    kept = len(found) - len(doomed)
    print(f"gc: {len(doomed) - len(failed)} deleted, {kept} kept (in use)", file=out)
    if failed:
        print(f"imexd gc: not deleted (see above): {'; '.join(failed)}", file=err)
        return EXIT_FAILED
    return EXIT_OK
