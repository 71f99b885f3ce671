"""Membership of one (domain, clique) shard: who holds which slot, and what this node does.

The modules, lowest first:
- `desired`: `Desired`, what should run on this node, the one value the agent's
  reconciler takes from here;
- `claim`: the values the slot rules take and give (our published claim, a step's
  decision, the resolved shard, a claim's barrier);
- `slots`: the slot rules, pure (the conflict rule `resolve`, the claim state machine
  `step`, incumbency), and the argument why two members never share a slot;
- `shard`: `ShardView`, the agent's view of its shard: bus events in (`apply`), a `Plan`
  out (`derive`), and the guards around the slot rules (reconnects, stale claims,
  duplicates, records written over ours, the one rule of when the daemon may stop);
  its parts, lowest first: `plan` (`Plan`, `own_change`, the first start's hold),
  `peers` (the book of the shard's records), `namesake` (another live agent with our
  name), `own` (the view's state and our own record's lifecycle), `intake` (records,
  clears, wills and presences taken in).

All are pure: no I/O (`shard` and its parts only log, through the logger it is given), no
asyncio, no clock of their own. `desired` imports only the facts' `Member`, `claim` and
`slots` only the wire format (`imexd.messages`); `shard` and its parts also the bus's
events (`imexd.bus.events`, no I/O), the facts it fills, the settings, the state file's
record and the topics.
Nothing here imports the agent, the bus's link, the daemon, health or the control plane;
the agent and `imexd render` call in.
"""
