"""A deterministic simulator of the membership core, with seeded fault schedules.

The agent's own cores (imexd.agent.core.NodeCore), each around a real `ShardView`
(imexd.membership.shard), run against a model broker on a simulated clock, fed as
imexd.agent.run feeds them; a seed fixes the nodes, the faults and every delivery
delay, and an oracle checks the three invariants of docs/membership.md during and after
each schedule (docs/simulation.md).

Test infrastructure, not product: nothing in imexd imports it. From imexd it takes the
node's core, the shard and what the agent feeds them (records, presences, the bus's
events, the node state), the backoff rule (`Rotation`), and the agent's and bus's
constants that shape the driving (`BEAT_S`, the stable-link time, the bus's echo
timeout), so that the model keeps their values.

- `timings`: the settings every view is built with, the fault model's bounds, and the
  oracle's bounds derived from both;
- `clock`: the simulated clock, its queue of timed actions and the run's random source;
- `broker`: the model broker (retained member records and presences, subscriptions,
  per-subscriber order, echoes, wills, sessions, restarts);
- `node`: one node: its core and `ShardView`, fed like the agent, its reconcile rounds
  and a model daemon;
- `oracle`: the invariants, checked while a schedule runs and after its quiet period;
- `schedule`: fault schedules generated from a seed, and kept valid when steps are cut;
- `world`: one run of a schedule (and the hostile writer);
- `diagnosis`: the cause of a violation, among the known ones;
- `shrink`: a smaller schedule that breaks the same rule;
- `batch`: many seeds, in a pool of processes, and what `scripts/simulate` prints;
- `known_failures`: the seeds of the CI range that break a rule on the current code.
"""
