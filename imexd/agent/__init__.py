"""The agent: the one process per node that joins its shard and keeps its IMEX daemon.

The modules, lowest first:
- `pacer`: how the loops wait on changes: bounded (`until`), and coalesced (`Pacer`, the
  report loop's);
- `gate`: the daemon's one gate: `admit` makes every order to stop, restart or retry the
  daemon (`DaemonOrder`), by the rule that guards a running daemon;
- `inputs`, `actions`: what the node's core takes in and what it asks for, plain values;
- `rounds`: the pacing of reconcile rounds (leading edge, settle, link proof, retries);
- `followed`: which peers' presences the node follows, and which a claim waits for;
- `core`: `NodeCore`, the node's decisions without I/O: inputs with the time in,
  actions out;
- `statefile`: the state files across restarts (`StateStore`, and `RecordFile` for the
  control-plane records held), read once, saved on change;
- `reconcile`: `Desired` made real in the IMEX files and the daemon (`Reconciler`, and
  the `reconcile` task), the only writer of the files and the only caller of the
  supervisor (a stop, restart or retry only as an order of the gate);
- `probes`: the `probe` task, when to ask the daemon's `ctl` and what it last said;
- `rebuild`: the newest control-plane records this node follows (`imexd.order`), passed
  on only when newer, and the anti-entropy pass that gives the broker back what it serves
  older or not at all (`Rebuilder`, and its task);
- `presences`, `report`, `discovery`: the tasks that follow the peers' presences, report
  the node's health, and discover its clique;
- `snapshot`: the agent's facts gathered in one `Facts` for health;
- `run`: `run(settings, stop=..., handover=...)` and `Agent`, the driver: it owns the
  tasks and the I/O, feeds the core and carries out its actions.

This is the top of the node's layers: it may import every package below it (`bus`,
`membership`, `daemon`, `channels`, `health`) and the leaves. Only the command line
imports it; nothing here imports the command line, the control plane, the demo or the
simulator.
"""
