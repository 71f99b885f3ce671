"""The control plane: `imexd domain ...` and `imexd node ...`, a CLI over the agents' bus.

Agents do all the work; the control plane only writes the two retained inputs they follow
(a domain's `DomainSpec` and each node's `Assignment`) and reads the two retained outputs
they publish (`MemberRecord`s and `HealthReport`s):

- `domain create NAME [--nodes a,b] [--max-nodes N]`: the spec (state `active`, generation
  one above the previous spec's), then an assignment for each listed node;
- `domain delete NAME [--timeout S]`: the spec in state `deleting`, a wait until no member
  record of NAME is left, then the assignments pointing at NAME, the spec and leftover
  health reports are cleared (see `commands.delete` for what happens at the timeout);
- `domain list`, `domain status NAME [--json] [--watch] [--wait S]`: tables judged by the
  pure `imexd.fleet.judge` (UP / DEGRADED / DOWN / FORMING / UNKNOWN, see there);
- `node assign NODE DOMAIN`, `node unassign NODE`.

Exit codes: 0 success (for `status`: the domain is UP), 1 failure (broker unreachable, a
write the broker did not keep, members left at a delete's timeout, a domain not UP),
2 usage errors (a name that is not DNS-1123), 130 interrupted.

The modules, one job each: `link` (one short-lived connection over `imexd.mqtt`),
`store` (what the link saw, by what it addresses), `commands` (the typed coroutines the
CLI runs) and `schemas` (the JSON Schemas shipped in docs/schemas/). Argument parsing,
the event loop and signals are `imexd.cli`'s.
"""
