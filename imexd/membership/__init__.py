"""Membership of one (domain, clique) shard: who holds which slot, and what this node does.

The modules, lowest first:
- `slots`: the slot rules, pure (the conflict rule `resolve`, the claim state machine
  `step`, incumbency), and the argument why two members never share a slot;
- `shard`: `ShardView`, the agent's view of its shard: bus events in (`apply`), a `Plan`
  out (`derive`), and the guards around the slot rules (reconnects, stale claims,
  duplicates, records written over ours, the one rule of when the daemon may stop).

Both are pure: no I/O (`shard` only logs, through the logger it is given), no asyncio,
no clock of their own. `slots` imports only the wire format (`imexd.messages`); `shard`
also the bus's events (`imexd.bus.events`, no I/O), the facts it fills, the settings,
the state file's record, the topics and the reconciler's `Desired`. Nothing here imports
the agent, the bus's link, health or the control plane (the reconciler brings the
supervisor and the metrics along, but no module here calls them); the agent and
`imexd render` call in.
"""
