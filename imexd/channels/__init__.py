"""IMEX channels per workload: the devices a node makes, the task that keeps them, and the
judgement whether a workload's channel is ready.

The modules, lowest first:
- `devices`: the channel devices: what the driver offers (`read_driver`), the pure
  per-node `plan` (which device each workload gets, refusals; `channel_holders`), and
  `Devices`, which makes the device nodes, CDI specs and env files exactly the wanted set;
- `fleet`: whether a workload's channel is ready on every node it lists
  (`judge_workload`), from the nodes' health reports, and the tables of `imexd workload`;
  pure, read by the control plane;
- `keeper`: the agent's `channels` task (`ChannelKeeper`): follows the workload records
  of the node's domain and applies `devices.plan` in a worker thread.

It imports the leaves and the contract (`imexd.errors`, `imexd.files`, `imexd.messages`,
`imexd.settings`, `imexd.topics`, `imexd.retry`, `imexd.logs`, `imexd.facts`); `fleet`
also `imexd.health.fleet` (report freshness and the table layout, shared with the
domain's judgement); `keeper`, the agent's task, also the bus's events (`imexd.bus.events`) and
`imexd.health.guard` (its heartbeat). Nothing here imports the agent, the command line or the
control plane, which call in.
"""
