"""The IMEX simulator: stand-ins for `nvidia-imex` and `nvidia-imex-ctl`.

`imexd-sim-daemon` (daemon.py) and `imexd-sim-ctl` (ctl.py) take the same flags, read
the same files, obey the same signals and print the same words and formats as the real
tools (see docs/simulator.md for what is and is not modelled), so the agent can be
tested, demonstrated and benchmarked on machines without GPUs. Simulated daemons
really listen, really connect to the addresses their host names resolve to and report
real connectivity; many share one machine by binding different 127.0.0.0/8 addresses.

Modules: `cfgfile` (config.cfg's keys), `command` (the ctl's side of the command
service: where it listens, blocking round trips, `-q`'s frames, the status replies as
`-N` reads them), `hosts` (names to addresses, the sentinel), `config` (the rest of what
both tools read: nodes_config.cfg, identity, the `IMEXD_SIM_*` knobs), `protocol` (the
peer and command frames, msgspec), `links` (the daemon's peer links), `imexlog` (IMEX's
log format), `table` (the `-N` text and JSON renderings, pure), `daemon` and `ctl` (the
two programs). `ctl -q` imports only `cfgfile` and `command`; `ctl -N` adds `hosts` and
`table`, and neither imports msgspec or an event loop. Of imexd it imports `imexd.errors`
only, so the agent's parsers are tested against words written apart from them.
"""


def daemon_main() -> int:
    """`imexd-sim-daemon`: the simulated daemon, in a process without the ssl module.

    It speaks no TLS, and asyncio loads OpenSSL at import unless ssl is unavailable: a
    cost at every start of the simulated daemon that the real daemon (a C++ program)
    does not have, paid once per node in every benchmarked job start.
    """
    import sys  # noqa: PLC0415 - this package's import stays free for the ctl

    if "ssl" not in sys.modules:
        sys.modules["ssl"] = None  # type: ignore[assignment]  # asyncio: "import ssl" fails
    from imexd.sim.daemon import main  # noqa: PLC0415 - after the line above

    return main()
