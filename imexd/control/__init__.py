"""The control plane: `imexd domain|node|workload|gc ...`, a CLI over the agents' bus.

Agents do all the work; the control plane only writes the retained inputs they follow
(a domain's `DomainSpec`, each node's `Assignment` and each workload's `WorkloadRecord`)
and reads the two retained outputs they publish (`MemberRecord`s and `HealthReport`s):

- `domain create NAME [--nodes a,b] [--max-nodes N] [--channel [N]]`: the spec (state
  `active`, generation one above what the broker serves, `imexd.order`), then an
  assignment for each listed node; with `--channel`, workload NAME of the domain on that
  channel (one domain per job);
- `domain delete NAME [--timeout S]`: the spec in state `deleting`, a wait until no member
  record of NAME is left, then the tombstones of the spec, the domain's workloads and the
  assignments pointing at NAME, and leftover health reports cleared (see
  `commands.delete` for what happens at the timeout);
- `domain list`, `domain status NAME [--json] [--watch] [--wait S]`: tables judged by the
  pure `imexd.health.fleet.judge` (UP / DEGRADED / DOWN / FORMING / UNKNOWN, see there);
- `node assign NODE DOMAIN`, `node unassign NODE`, `node forget NODE` (a dead node's
  records), `node retry NODE` (ask its agent to try a FATAL daemon again);
- `workload create|delete|list|status|env`: a workload's retained `WorkloadRecord`, the
  IMEX channel the agents of its nodes make for it, allocated race-free among concurrent
  clients (see `workloads`), judged by the pure `imexd.channels.fleet.judge_workload`.
- `gc [--live-jobs IDS | --live-jobs-file FILE] [--older-than S] [--tombstones S]
  [--apply]`: the domains and workloads dead Slurm jobs left (`job-<id>`), listed, and
  deleted with `--apply` through the two deletes above, and tombstones older than S
  seconds, cleared (see `gc` for the selectors and the in-use rule).

Exit codes: 0 success (for `status`: the domain is UP), 1 failure (broker unreachable, a
write the broker did not keep, members left at a delete's timeout, a domain not UP),
2 usage errors (a name that is not DNS-1123), 3 no free channel (`workload create`),
130 interrupted.

With `[control] private_key` every spec, workload, assignment and retry request is signed
where the link puts it (`link.Link.seal`, `imexd.signing`). Every one of them carries a
generation one above what the broker served on its topic, and a deletion is a tombstone,
a record too (`commands.deleted_workload`, `commands.assignment`; imexd.order): the
control plane clears none of them, but `gc --tombstones` clears old tombstones.

The modules, one job each: `link` (one short-lived connection over `imexd.bus.mqtt`),
`store` (what the link saw, by what it addresses), `commands` (the typed coroutines the
CLI runs for domains and nodes), `workloads` (those for workloads), `gc` (leftovers) and
`schemas` (the JSON Schemas shipped in docs/schemas/). Argument parsing, the event loop
and signals are `imexd.cli.main`'s.

It may import the leaves, the bus's MQTT layer, broker repairs and signature check, and
the pure fleet judgements (`imexd.health.fleet`, `imexd.channels.fleet`); never the agent,
the shard or the daemon: it runs on no node (tests/test_layout.py holds the arrows).
"""
