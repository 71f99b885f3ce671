"""The IMEX daemon as one supervised process: everything that starts, watches, asks and
stops `nvidia-imex`.

- `supervisor`: the state machine (`Supervisor`) around one daemon;
- `state`: its snapshot (`DaemonState`, `DaemonReason`, `DaemonStatus`), a leaf;
- `process`: the system calls of one daemon process (spawn, adopt, pidfd, signals);
- `output`: its output files, tailed into the log;
- `inotify`: the wake-up when it writes them (Linux inotify), so no timer reads them;
- `ctl`: `nvidia-imex-ctl -q` and `-N -j`, run bounded and parsed (`Prober`); when to
  ask is the agent's `probe` task (`imexd.agent.probes`).

It imports the leaves (`imexd.imex`, `imexd.errors`, `imexd.logs`, `imexd.settings`,
`imexd.retry`, `imexd.process`) and nothing else: not the agent, the bus, health or the
control plane. `imexd.facts` and `imexd.health.fleet` import the snapshot types of `state`
and `ctl`.
"""
