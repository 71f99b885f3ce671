"""`imexd demo`: a whole IMEX domain of simulated nodes on this machine, for a newcomer.

A newcomer should see what imexd does before owning a GPU rack or root: N agents
(`imexd run`, exactly as shipped) each supervise a simulated IMEX daemon
(`imexd-sim-daemon`) on its own loopback address, meet over an MQTT broker, form the
domain "demo", give a workload its own IMEX channel on a simulated driver and take it
back, survive two crashes, and leave. The demo only starts processes (the agents, and
the `imexd workload` commands as a user types them), reads each agent's `/status`, the
members' records on the bus and the nodes' channel files, and sends signals, so what it
shows is the product's behaviour, not a re-enactment.

One job per module:

- `brokers`: free ports and loopback addresses, and the MQTT brokers the demo runs its
  agents on (Mosquitto as a child process, amqtt inside this process, or one given with
  `--broker`); the tests and the benchmarks extend its Mosquitto launcher;
- `timings`: the one table of fast timings (the demo's agents and the scenario tests'
  agents react in seconds with it);
- `nodes`: the simulated nodes (folder, settings, `imexd run` process) and the sweep
  that ends whatever the demo started;
- `screen`: the table of nodes and the terminal it is drawn on;
- `scenario`: the five acts (form, a workload, kill a daemon, kill an agent, leave), what
  they measure, and the cleanup.

The domain is judged as `imexd domain status` judges it (`imexd.health.fleet.judge`).
It may import the leaves, the control plane's link and the fleet judgement; never the
agent's code, which runs in the processes it starts (tests/test_layout.py).
"""

from __future__ import annotations

from imexd.errors import ImexdError


class DemoError(ImexdError):
    """The demo could not show what it promised; the message says why (exit 1)."""


__all__ = ["DemoError"]
