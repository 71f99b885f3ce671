"""The node's health and the domain's: the judgements of the facts, and how they are served.

The modules, lowest first:
- `fleet`: whether a domain is UP, the one home of that rule: `links` and `sight` (one
  node), `judge` (the fleet, from every member's record and report), and the tables
  imexd prints; pure;
- `conditions`: the agent's facts in, conditions, readiness and the HealthReport out
  (`Health`, `ReportSchedule`), and the task heartbeats (`Heartbeats`); pure;
- `metrics`: the Prometheus series of one agent, a view of the same facts (`Metrics`);
- `exposition`: the Prometheus text format those series are written in; pure;
- `http`: the agent's HTTP endpoint (`HealthServer`: `/healthz`, `/readyz`, `/status`,
  `/metrics`), which only reads the three above;
- `guard`: the containment of the agent's named tasks (restarts with backoff) and their
  heartbeats, which `/healthz` reads;
- `sdnotify`: systemd's notify protocol (READY=1, STATUS=, WATCHDOG=1, STOPPING=1).

It imports the leaves and the contract (`imexd.facts`, `imexd.imex`, `imexd.messages`,
`imexd.topics`, `imexd.settings`, `imexd.errors`, `imexd.logs`, `imexd.retry`, and
`imexd` for the version); `fleet` reads the types of `imexd.daemon.ctl`'s table, for
type checking only. Nothing here imports the agent, the bus, the command line or the
control plane: they, the daemon's probe task and the channels' keeper use its guard and
read what it decides.
"""
