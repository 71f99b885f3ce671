"""The nats-server builds the NATS tests run on, as pytest parameters.

- "debian": Debian 12's package (2.9.10), `/usr/sbin/nats-server` or the one on PATH
  (`find_nats_server`); scripts/test installs it.
- "2.14.0": the upstream 2.14.0 binary at `$IMEXD_TEST_NATS_CURRENT`, which scripts/test
  fetches (scripts/fetch-nats-server: pinned by version and sha256) and exports.

A build that is not there is a skipped parameter saying how to get it. A test or fixture
parametrized with `PARAMS` gets the binary's path (pass it to `Nats(binary=...)`).
"""

from __future__ import annotations

import os
from typing import Any, Final

import pytest

from tests.nats_servers import find_nats_server

CURRENT_ENV: Final = "IMEXD_TEST_NATS_CURRENT"
"""The environment variable naming the nats-server 2.14.0 binary."""


def _param(build_id: str, binary: str | None, missing: str) -> Any:
    if binary is None or not os.access(binary, os.X_OK):
        return pytest.param(None, id=build_id, marks=pytest.mark.skip(reason=missing))
    return pytest.param(binary, id=build_id)


def params() -> list[Any]:
    """One parameter per build: its binary's path, or a skipped one when it is missing."""
    current = os.environ.get(CURRENT_ENV) or None
    return [
        _param(
            "debian",
            find_nats_server(),
            "nats-server is not installed (apt-get install nats-server)",
        ),
        _param(
            "2.14.0",
            current,
            f"no nats-server 2.14.0: ${CURRENT_ENV} is "
            + (f"{current!r}, not an executable" if current else "not set")
            + " (scripts/test fetches it: scripts/fetch-nats-server)",
        ),
    ]


PARAMS: Final = params()

CLUSTER_CURRENT_ENV: Final = "IMEXD_TEST_NATS_CLUSTER_CURRENT"
"""Set (to anything) to run the three-server tests on 2.14.0 too. Not in CI: a 2.14.0
cluster is not supported across a server failure (a live server's retained feed can die
with the killed one, docs/brokers.md *Which nats-server versions*), so its fail-over test
fails in some runs; the feed test shows why."""

CLUSTER_PARAMS: Final = PARAMS if os.environ.get(CLUSTER_CURRENT_ENV) else PARAMS[:1]
"""The builds the three-server tests run on: Debian's, and 2.14.0 on request."""
