"""A deterministic simulator of the membership core, with seeded fault schedules.

Real `ShardView`s (imexd.membership.shard) run against a model broker on a simulated
clock, driven as imexd.agent.run drives them; a seed fixes the nodes, the faults and every
delivery delay, and an oracle checks the three invariants of docs/membership.md during
and after each schedule. Test infrastructure, not product: nothing here is imported by
imexd, and it imports from imexd only the shard, the records and the bus's events.

- `timings`: the settings every view is built with, the fault model's bounds, and the
  oracle's bounds derived from both;
- `broker`: the model broker (retained records, per-subscriber order, echoes, wills,
  sessions, restarts);
- `node`: one node: its `ShardView`, driven like the agent, its reconcile loop and a
  model daemon;
- `oracle`: the invariants, checked while a schedule runs and after its quiet period;
- `schedule`: fault schedules generated from a seed, and kept valid when steps are cut;
- `world`: the clock and event queue that runs one schedule;
- `shrink`: a smaller schedule that breaks the same rule;
- `batch`: many seeds, in a pool of processes, and what `scripts/simulate` prints.
"""
