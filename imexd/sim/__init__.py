"""The IMEX simulator: stand-ins for `nvidia-imex` and `nvidia-imex-ctl`.

`imexd-sim-daemon` (daemon.py) and `imexd-sim-ctl` (ctl.py) take the same flags, read
the same files, obey the same signals and print the same words and formats as the real
tools (see docs/simulator.md for what is and is not modelled), so the agent can be
tested, demonstrated and benchmarked on machines without GPUs. Simulated daemons
really listen, really connect to the addresses their host names resolve to and report
real connectivity; many share one machine by binding different 127.0.0.0/8 addresses.

Modules: `config` (config.cfg, nodes_config.cfg, name resolution, identity), `wire`
(the peer and command protocols), `imexlog` (IMEX's log format), `table` (the `-N`
text and JSON renderings, pure), `daemon` and `ctl` (the two programs).
"""
