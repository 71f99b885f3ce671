"""The `discover` task: NVML fabric discovery when `[node] clique = "auto"`.

At once, then every `[node] discover_interval_s`; a failure is tried again on the local
backoff (`rounds.LOCAL_RETRY_S`, at most that interval), so a fault that clears is soon
noticed. Each outcome is handed on (`found`): the fabric facts, and what the node's core
takes in (None after a failure).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import structlog

from imexd.agent.inputs import Discovered
from imexd.agent.rounds import LOCAL_RETRY_S
from imexd.errors import DiscoveryError
from imexd.facts import FabricFacts
from imexd.health.guard import Guard
from imexd.retry import backoff_delay

DISCOVERY_TIMEOUT_S: Final = 20.0
"""One NVML discovery (in a child process) is killed after this: a hung driver cannot
wedge the agent."""


async def run(
    guard: Guard,
    *,
    interval_s: float,
    found: Callable[[FabricFacts, Discovered | None], None],
    log: structlog.typing.FilteringBoundLogger,
) -> None:
    """Discover, and hand each outcome to `found`."""
    # Lazy: an agent with a clique in its settings never runs this task, nor needs NVML's
    # ctypes records and the child's code.
    import imexd.fabric  # noqa: PLC0415

    next_at, failures = 0.0, 0
    while True:
        guard.heartbeats.beat("discover")
        if time.monotonic() < next_at:
            await guard.rest("discover", None, next_at)
            continue
        try:
            outcome = await imexd.fabric.discover(DISCOVERY_TIMEOUT_S)
        except DiscoveryError as exc:
            delay = min(backoff_delay(failures, *LOCAL_RETRY_S), interval_s)
            failures += 1
            log.error("fabric.discovery_failed", error=str(exc), retry_in_s=round(delay, 2))
            next_at = time.monotonic() + delay
            found(FabricFacts(source="nvml", error=str(exc)), None)
        else:
            failures = 0
            next_at = time.monotonic() + interval_s
            driver = outcome.report.driver_version or ""
            found(FabricFacts(source="nvml"), Discovered(outcome.clique, driver, outcome.reason))
