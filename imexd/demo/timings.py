"""The one table of fast timings: production settings shortened so agents react in seconds.

The demo, the scenario tests (tests/cluster.py) and whatever else runs real agents on one
machine for a person who is waiting use this table, so that a figure the demo shows and a
timing a test relies on come from the same settings. The benchmark does not: it measures
the shipped defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

FAST: Final[Mapping[str, Mapping[str, float | int]]] = {
    "domain": {"settle_s": 0.2},
    "bus": {
        "ping_interval_s": 1.0,
        "will_delay_s": 2.0,
        "reconnect_initial_s": 0.2,
        "reconnect_max_s": 1.0,
        "keepalive_s": 5.0,
    },
    "imex": {"reload_min_interval_s": 1.2},
    "daemon": {
        "start_s": 0.3,
        "stable_s": 5.0,
        "backoff_initial_s": 0.2,
        "backoff_max_s": 1.0,
        "crash_loop_starts": 3,
        "crash_loop_window_s": 30.0,
        "fatal_cooldown_s": 60.0,
        "stop_timeout_s": 3.0,
        "probe_interval_s": 5.0,
        "domain_probe_interval_s": 5.0,
        "probe_timeout_s": 3.0,
    },
    "health": {"report_interval_s": 2.0},
}
"""Settings overrides by section. `reload_min_interval_s` 1.2 s fits the simulator's
SIGUSR1 window of SIM_RELOAD_WINDOW_S. The timed probes run every 5 s: each is a Python
process of the simulator, and many nodes on one small machine probing faster starve it
(docs/performance.md). What the agent waits for does not wait on them: a start, a
SIGUSR1 and every line the daemon writes while it is not READY or a member is missing
from its links probe at once, and a quick series follows each change
(`imexd.agent.probes`)."""

SIM_RELOAD_WINDOW_S: Final = "1"
"""IMEXD_SIM_RELOAD_WINDOW_S for the simulated daemons: one SIGUSR1 honoured per second
(the real daemon's window is 5 s)."""


def with_fast(sections: Mapping[str, Mapping[str, object]]) -> dict[str, dict[str, object]]:
    """`sections` (a settings mapping) with FAST laid over it, section by section."""
    out = {name: dict(values) for name, values in sections.items()}
    for name, values in FAST.items():
        out[name] = out.get(name, {}) | dict(values)
    return out
