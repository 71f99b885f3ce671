"""`imexd check` and `imexd status` as subprocesses against a real agent endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from msgspec.structs import replace

from imexd.cli.query import print_report
from imexd.demo.brokers import free_port
from imexd.facts import BusFacts, DaemonFacts, Facts, Member, MembershipFacts
from imexd.health.conditions import Health, Heartbeats
from imexd.health.http import HealthServer
from imexd.health.metrics import Metrics
from imexd.messages import HealthReport
from tests.support import imexd

READY = Facts(
    node="n1",
    domain="d1",
    clique="c0ffee.1",
    address="127.0.0.1",
    slot=3,
    bus=BusFacts(connected=True, synced=True),
    membership=MembershipFacts(state="member", members={3: Member("n1", "127.0.0.1")}),
    daemon=DaemonFacts(state="RUNNING", pid=77, restarts=4, imex_status="READY"),
)
CRASHING = replace(
    READY,
    daemon=DaemonFacts(
        state="FATAL",
        restarts=5,
        last_exit="exit 3",
        reason="DaemonCrashLoop",
        message="exit 3: cannot bind 127.0.0.1:50000",
    ),
)


class Clock:
    """A monotonic clock that only moves when told to."""

    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


class Endpoint:
    """A served agent state that the test can change."""

    def __init__(self, server: HealthServer, health: Health, clock: Clock) -> None:
        self.server = server
        self.health = health
        self.clock = clock

    @property
    def url(self) -> str:
        return self.server.url


@contextlib.asynccontextmanager
async def serving(facts: Facts, listen: str = "127.0.0.1:0") -> AsyncIterator[Endpoint]:
    clock = Clock()
    beats = Heartbeats(clock=clock)
    beats.register("main", 1.0)
    state = Health(facts)
    server = HealthServer(listen, heartbeats=beats, health=state, metrics=Metrics())
    async with server:
        yield Endpoint(server, state, clock)


@pytest.fixture
async def ready_agent() -> AsyncIterator[Endpoint]:
    """A ready agent on a free port."""
    async with serving(READY) as e:
        yield e


# check


async def test_check_ready_exits_0(ready_agent: Endpoint) -> None:
    """A ready agent makes the exec probe succeed."""
    done = await asyncio.to_thread(imexd, "check", "--url", ready_agent.url)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ready\n", "")


async def test_check_not_ready_prints_one_line_reason() -> None:
    """An unready agent fails the probe with the failing condition on one line."""
    async with serving(CRASHING) as e:
        done = await asyncio.to_thread(imexd, "check", "--url", e.url)
    assert done.returncode == 1
    assert done.stdout == (
        "not ready: DaemonReady=False DaemonCrashLoop: exit 3: cannot bind 127.0.0.1:50000\n"
    )


async def test_check_live_ignores_readiness_but_not_wedged_tasks() -> None:
    """--live passes while unready, and fails naming a wedged task."""
    async with serving(CRASHING) as e:
        live = await asyncio.to_thread(imexd, "check", "--live", "--url", e.url)
        assert (live.returncode, live.stdout) == (0, "live\n")
        e.clock.t += 10
        done = await asyncio.to_thread(imexd, "check", "--live", "--url", e.url)
    assert done.returncode == 1
    assert done.stdout == "not live: task main silent for 10.0 s (interval 1 s)\n"


async def test_check_unreachable_agent() -> None:
    """Nothing listening is a failed probe that names the URL."""
    url = f"http://127.0.0.1:{free_port()}"
    done = await asyncio.to_thread(imexd, "check", "--url", url)
    assert done.returncode == 1
    assert done.stdout.startswith(f"agent unreachable at {url}: ")
    assert "refused" in done.stdout
    assert done.stdout.count("\n") == 1


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (in the backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


async def test_check_times_out(silent_port: int) -> None:
    """An agent that does not answer in --timeout seconds fails the probe."""
    url = f"127.0.0.1:{silent_port}"
    done = await asyncio.to_thread(imexd, "check", "--timeout", "0.5", "--url", url)
    assert done.returncode == 1
    assert done.stdout.startswith(f"agent unreachable at http://127.0.0.1:{silent_port}: ")
    assert done.stdout.endswith(": no answer within 0.5 s\n")


async def test_check_reports_foreign_http_answers(ready_agent: Endpoint) -> None:
    """A URL that is not an imexd endpoint gives the HTTP status it got."""
    done = await asyncio.to_thread(imexd, "check", "--url", ready_agent.url + "/elsewhere")
    assert done.returncode == 1
    assert done.stdout == f"not ready: HTTP 404 from {ready_agent.url}/elsewhere/readyz\n"


async def test_check_ignores_proxy_variables(ready_agent: Endpoint) -> None:
    """HTTP_PROXY in the environment does not redirect a probe of the local agent."""
    proxy = {"HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}
    done = await asyncio.to_thread(imexd, "check", "--url", ready_agent.url, env=proxy)
    assert done.returncode == 0


async def test_check_default_url_from_settings(tmp_path: Path) -> None:
    """Without --url the probe asks `[health] listen`, wildcard hosts as loopback."""
    port = free_port()
    config = tmp_path / "imexd.toml"
    config.write_text(f'[node]\nname = "n1"\n[health]\nlisten = "0.0.0.0:{port}"\n')
    async with serving(READY, listen=f"127.0.0.1:{port}"):
        done = await asyncio.to_thread(imexd, "check", "--config", str(config))
    assert (done.returncode, done.stdout, done.stderr) == (0, "ready\n", "")


async def test_check_with_port_zero_needs_url(tmp_path: Path) -> None:
    """A listen port of 0 cannot be probed without --url: a configuration error."""
    config = tmp_path / "imexd.toml"
    config.write_text('[node]\nname = "n1"\n[health]\nlisten = "127.0.0.1:0"\n')
    done = await asyncio.to_thread(imexd, "check", "--config", str(config))
    assert done.returncode == 2
    assert "pass --url" in done.stderr


# status


async def test_status_shows_the_agent_for_a_person() -> None:
    """The human view names node, domain, slot, daemon, IMEX state and each condition."""
    async with serving(CRASHING) as e:
        done = await asyncio.to_thread(imexd, "status", "--url", e.url)
    assert done.returncode == 0
    assert "n1 (127.0.0.1)" in done.stdout
    assert "d1, clique c0ffee.1, slot 3" in done.stdout
    assert "FATAL, 5 restarts, last exit: exit 3" in done.stdout
    for kind in ("BusConnected", "SlotSettled", "DaemonReady", "DomainUp", "FabricReady"):
        assert kind in done.stdout
    assert "DaemonCrashLoop  exit 3: cannot bind 127.0.0.1:50000" in done.stdout


async def test_status_json_is_the_health_report(ready_agent: Endpoint) -> None:
    """--json prints the HealthReport, which decodes strictly."""
    done = await asyncio.to_thread(imexd, "status", "--json", "--url", ready_agent.url)
    assert done.returncode == 0
    rep = msgspec.convert(json.loads(done.stdout), HealthReport)
    assert (rep.node, rep.slot, rep.ready, rep.daemon.imex_status) == ("n1", 3, True, "READY")


async def test_status_unreachable_agent() -> None:
    """status fails with exit 1 and says where it looked."""
    url = f"http://127.0.0.1:{free_port()}"
    done = await asyncio.to_thread(imexd, "status", "--url", url)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(f"agent unreachable at {url}: ")


async def test_status_says_unknown_not_up_while_the_bus_is_down() -> None:
    """With the broker gone, `imexd status` shows the domain as UNKNOWN (BusDown), never UP."""
    down = replace(READY, bus=BusFacts(broker="mqtt://127.0.0.1:1", last_error="refused"))
    async with serving(down) as e:
        done = await asyncio.to_thread(imexd, "status", "--url", e.url)
    assert done.returncode == 0
    assert "domain state  UNKNOWN (BusDown)" in done.stdout
    assert "UP" not in done.stdout.split("conditions:")[0]


def test_status_lists_each_workload_channel() -> None:
    """A person sees the driver's channels and each workload's channel, ready or why not."""
    from io import StringIO

    from imexd.messages import ChannelInfo, ChannelsView

    rep = msgspec.structs.replace(
        Health(READY).report(),
        channels=ChannelsView(
            count=2048,
            major=242,
            workloads=[
                ChannelInfo(workload="job-7", channel=3, generation=1, ready=True),
                ChannelInfo(
                    workload="job-8", channel=4, generation=2, ready=False, reason="MknodFailed"
                ),
            ],
        ),
    )
    out = StringIO()
    print_report(rep, out)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("channels"))
    assert line.split(None, 1)[1] == (
        "2048 channels, major 242; job-7: channel 3 ready; job-8: channel 4 MknodFailed"
    )
    unknown = msgspec.structs.replace(rep, channels=ChannelsView())
    out = StringIO()
    print_report(unknown, out)
    assert "unknown count, no device major" in out.getvalue()
