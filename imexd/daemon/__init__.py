"""The IMEX daemon as one supervised process: everything that starts, watches, probes and
stops `nvidia-imex`.

- `supervisor`: the state machine (`Supervisor`) around one daemon;
- `state`: its snapshot (`DaemonState`, `DaemonReason`, `DaemonStatus`), a leaf;
- `process`: the system calls of one daemon process (spawn, adopt, pidfd, signals);
- `output`: its output files, tailed into the log;
- `ctl`: `nvidia-imex-ctl -q` and `-N -j`, run bounded and parsed (`Prober`);
- `probes`: the agent's `probe` task, when to ask `ctl` and what it last said.

It imports the leaves (`imexd.imex`, `imexd.errors`, `imexd.logs`, `imexd.settings`,
`imexd.retry`, `imexd.process`); `probes`, the agent's task, also `imexd.guard` (its
heartbeat), `imexd.health.metrics` and `imexd.health.fleet` (the link facts). Nothing
here imports the agent, the bus or the control plane; `imexd.facts` and
`imexd.health.fleet` import the snapshot types of `state` and `ctl`.
"""
