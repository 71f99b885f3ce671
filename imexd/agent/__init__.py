"""The agent: the one process per node that joins its shard and keeps its IMEX daemon.

The modules, lowest first:
- `pacer`: leading-edge coalescing for the report loop, which recomputes on every change;
- `statefile`: the state files across restarts (`StateStore`, and `RecordFile` for the
  control-plane records held), read once, saved on change;
- `reconcile`: `Desired` made real in the IMEX files and the daemon (`Reconciler`), the
  only writer of the files and the only caller of the supervisor's start, reload and
  restart;
- `probes`: the `probe` task, when to ask the daemon's `ctl` and what it last said;
- `rebuild`: the newest control-plane records this node follows (`imexd.order`), passed
  on only when newer, and the anti-entropy pass that gives the broker back what it serves
  older or not at all (`Rebuilder`, and its task);
- `run`: `run(settings, stop=..., handover=...)` and `Agent`, which wires the others
  together and owns their tasks.

This is the top of the node's layers: it may import every package below it (`bus`,
`membership`, `daemon`, `channels`, `health`) and the leaves. Only the command line
imports it; nothing here imports the command line, the control plane, the demo or the
simulator.
"""
