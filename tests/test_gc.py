"""`imexd gc`: what failed Slurm epilogs left on the bus, listed, and with --apply deleted.

The pure parts (which names are a job's, which ids squeue printed) with plain asserts;
the command in-process against a real Mosquitto, with the records an agent and the
Slurm scripts would leave retained there, read back after each run.
"""

from __future__ import annotations

import asyncio
import io
import os
import time
from pathlib import Path

import pytest

from imexd.cli.main import main
from imexd.demo.brokers import free_port
from imexd.messages import DomainSpec, WorkloadRecord, encode
from imexd.names import job_of, parse_job_ids
from tests.brokers import Mosquitto
from tests.test_control import T, domain_state, fake_agents, put, retained, standing
from tests.test_workloads import channel_report, info

WAIT = "2"
"""--wait of every delete here: nothing in these tests needs an agent to leave."""


@pytest.fixture(autouse=True)
def generations_from_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record on an empty topic starts at generation 0 here, not at the clock's second
    (tests/test_order.py and tests/test_control.py hold that), so that a new workload's
    claim is 0 and its active record 1, which the reports here name."""
    monkeypatch.setattr("imexd.order.first_generation", lambda now=None: 0)


@pytest.fixture
def env(broker: Mosquitto, monkeypatch: pytest.MonkeyPatch) -> None:
    """A control plane that reaches `broker` with no settings file."""
    for name in list(os.environ):
        if name.startswith("IMEXD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("IMEXD_BUS_URL", broker.url)
    monkeypatch.setenv("IMEXD_HEALTH_REPORT_INTERVAL_S", "30")


async def gc(*args: str) -> int:
    """`imexd gc ARGS` in a worker thread (its own event loop), bounded in time."""
    async with asyncio.timeout(60):
        return await asyncio.to_thread(main, ["gc", *args])


def spec(domain: str) -> bytes:
    return encode(DomainSpec(domain=domain, max_nodes=8, generation=1))


def workload(name: str, domain: str, channel: int, **fields: object) -> bytes:
    return encode(
        WorkloadRecord(
            workload=name,
            domain=domain,
            channel=channel,
            generation=1,
            **fields,  # type: ignore[arg-type]
        )
    )


def leftovers() -> dict[str, bytes | None]:
    """Job 101's per-job domain (with its workload), job 102's workload in a shared domain,
    running job 103's domain, and names no job owns (`rack-07`, a non-canonical id)."""
    return {
        T.spec("job-101"): spec("job-101"),
        T.workload("job-101", "job-101"): workload("job-101", "job-101", 0),
        T.spec("shared"): spec("shared"),
        T.workload("shared", "job-102"): workload("job-102", "shared", 1),
        T.workload("shared", "job-103"): workload("job-103", "shared", 2),
        T.spec("job-103"): spec("job-103"),
        T.spec("rack-07"): spec("rack-07"),
        T.spec("job-0104"): spec("job-0104"),
        T.workload("rack-07", "train"): workload("train", "rack-07", 1),
    }


# Pure parts.


def test_only_the_scripts_canonical_job_names_name_a_job() -> None:
    """`job-<id>` is a job's; other names, and a zero-padded id, are nobody's."""
    assert job_of("job-101") == 101
    assert job_of("rack-07") is None
    assert job_of("job-0104") is None
    assert job_of("job-") is None
    assert job_of("job-12a") is None
    assert job_of("myjob-5") is None


def test_job_ids_are_read_as_squeue_prints_them() -> None:
    """Whitespace or commas between plain numeric ids; anything else is named as bad."""
    assert parse_job_ids("101\n102 103,104\n") == (frozenset({101, 102, 103, 104}), [])
    assert parse_job_ids("") == (frozenset(), [])
    assert parse_job_ids(" 7, 12_3 abc ") == (frozenset({7}), ["12_3", "abc"])


# The command against a broker.


async def test_a_dry_run_lists_the_dead_jobs_records_and_changes_nothing(
    broker: Mosquitto, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --apply: one row per candidate (kind, domain, workload, why), exit 0, and
    the bus as it was; a live job's records and names no job owns are never listed."""
    await put(broker, leftovers())
    before = await retained(broker)
    assert await gc("--live-jobs", "103\n104") == 0
    assert await retained(broker) == before
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert rows[0][:4] == ["KIND", "DOMAIN", "WORKLOAD", "WHY"]
    listed = {(r[0], r[1], r[2]) for r in rows[1:] if r and r[0] in ("domain", "workload")}
    assert listed == {
        ("workload", "job-101", "job-101"),
        ("workload", "shared", "job-102"),
        ("domain", "job-101", "-"),
    }
    assert "job 101 is not in --live-jobs" in out
    assert "dry run: nothing changed" in out
    assert "--apply" in out


async def test_apply_deletes_a_dead_jobs_domain_and_workload_through_the_deletes(
    broker: Mosquitto, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --apply, job 101's domain and job 102's workload go as `domain delete` and
    `workload delete` take them; job 103's, `rack-07` and `job-0104` stay untouched."""
    await put(broker, leftovers())
    before = await retained(broker)
    assert await gc("--live-jobs", "103,104", "--apply", "--wait", WAIT) == 0
    after = await standing(broker)
    gone = {T.spec("job-101"), T.workload("job-101", "job-101"), T.workload("shared", "job-102")}
    assert after == {k: v for k, v in before.items() if k not in gone}
    out = capsys.readouterr().out
    assert "workload job-102 in shared: deleted (channel 1 freed)" in out, "workload delete's"
    assert "domain job-101: deleted" in out, "domain delete's own line"


async def test_a_job_above_every_live_id_may_be_newer_than_the_list(
    broker: Mosquitto, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slurm counts job ids up: job 105, above the listed 104, may have started after
    squeue ran, so its records are not selected."""
    await put(broker, {T.spec("job-105"): spec("job-105"), T.spec("job-99"): spec("job-99")})
    assert await gc("--live-jobs", "104", "--apply", "--wait", WAIT) == 0
    got = await standing(broker)
    assert T.spec("job-105") in got
    assert T.spec("job-99") not in got
    assert "job-105" not in capsys.readouterr().out


async def test_an_empty_live_job_list_selects_every_jobs_records_only(
    broker: Mosquitto, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """No job running (squeue printed nothing): every job's records, still no other name."""
    await put(broker, leftovers())
    assert await gc("--live-jobs", "") == 0
    out = capsys.readouterr().out
    assert "job 103 is not in --live-jobs" in out
    assert "rack-07" not in out
    assert "job-0104" not in out
    assert "--live-jobs is empty" in out


async def test_the_live_jobs_file_and_stdin_give_the_ids(
    broker: Mosquitto,
    env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--live-jobs-file FILE` and `--live-jobs-file -` (squeue piped in) read the same ids."""
    await put(broker, leftovers())
    jobs = tmp_path / "jobs"
    jobs.write_text("101\n102\n103\n")
    assert await gc("--live-jobs-file", str(jobs)) == 0
    assert "nothing to collect" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("101 103\n"))
    assert await gc("--live-jobs-file", "-") == 0
    out = capsys.readouterr().out
    assert "job 102 is not in --live-jobs" in out
    assert "job 101 is not" not in out


async def test_older_than_spares_a_workload_whose_channel_is_ready_on_a_node(
    broker: Mosquitto, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """--older-than alone: an old workload whose node reports its channel ready is in use,
    kept with the reason; an old one no live node reports is deleted; a young one is not
    selected; domains are never selected by age (a spec has no creation time)."""
    now = time.time()
    old = now - 7200
    ready = channel_report("n1", 0, infos=[info("w-used", 1, 1)], at=now, domain="shared")
    state = {T.spec("shared"): spec("shared"), T.spec("job-9"): spec("job-9")}
    for channel, (name, node, created) in enumerate(
        [("w-used", "n1", old), ("w-gone", "n2", old), ("w-new", "n2", now)], start=1
    ):
        state[T.workload("shared", name)] = workload(
            name, "shared", channel, nodes=[node], created=created
        )
    state[T.health("shared", "n1")] = encode(ready)
    await put(broker, dict(state))
    assert await gc("--older-than", "3600", "--apply", "--wait", WAIT) == 0
    got = await standing(broker)
    assert T.workload("shared", "w-gone") not in got
    assert T.workload("shared", "w-used") in got
    assert T.workload("shared", "w-new") in got
    assert T.spec("job-9") in got
    out = capsys.readouterr().out
    assert "kept workload w-used in shared: in use: its channel is ready on n1" in out
    assert "--older-than applies to workloads only" in out


async def test_older_than_with_live_jobs_needs_both(
    broker: Mosquitto, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both selectors: a dead job's workload younger than --older-than is not selected."""
    now = time.time()
    await put(
        broker,
        {
            T.workload("shared", "job-5"): workload("job-5", "shared", 1, created=now - 7200),
            T.workload("shared", "job-6"): workload("job-6", "shared", 2, created=now),
        },
    )
    assert await gc("--live-jobs", "7", "--older-than", "3600") == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert {r[2] for r in rows if r and r[0] == "workload"} == {"job-5"}


async def test_a_dead_jobs_domain_whose_daemons_still_run_is_not_in_use(
    broker: Mosquitto, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a job list the list decides: job 301's domain, its members live and reporting,
    is deleted; its agents leave on `deleting` as for `domain delete`."""
    state = domain_state("job-301", ["n1", "n2"])
    state[T.spec("job-301")] = spec("job-301")
    await put(broker, state)
    async with fake_agents(broker, ["n1", "n2"], domain="job-301") as left:
        assert await gc("--live-jobs", "302", "--apply", "--wait", "20") == 0
        assert sorted(left) == ["n1", "n2"]
    assert await standing(broker) == {}
    out = capsys.readouterr().out
    assert "domain job-301: deleted" in out
    assert "gc: 1 deleted, 0 kept (in use)" in out


async def test_a_delete_that_fails_exits_1_and_the_others_still_run(
    broker: Mosquitto, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dead job's domain whose members never leave: its delete fails (exit 1), and the
    next candidate is still deleted."""
    state = domain_state("job-201", ["n1"])
    state[T.spec("job-201")] = spec("job-201")
    state[T.workload("shared", "job-202")] = workload("job-202", "shared", 1)
    await put(broker, state)
    assert await gc("--live-jobs", "", "--apply", "--wait", "0.5") == 1
    got = await standing(broker)
    assert T.workload("shared", "job-202") not in got
    assert T.member("job-201", "c1", "n1") in got
    assert "still hold records" in capsys.readouterr().err


def test_gc_without_a_selector_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """No --live-jobs, --live-jobs-file or --older-than: exit 2 before any broker is tried."""
    assert main(["gc", "--apply"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("imexd gc: ")
    assert "--live-jobs" in err
    assert "--older-than" in err


def test_a_malformed_live_jobs_value_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A word that is not a plain job id is named; nothing is tried."""
    assert main(["gc", "--live-jobs", "101 12_3,abc"]) == 2
    err = capsys.readouterr().err
    assert "'12_3'" in err
    assert "'abc'" in err
    assert "squeue -h -o %A" in err


def test_other_bad_values_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative --older-than or --wait, an unreadable file, or both id options: exit 2."""
    assert main(["gc", "--older-than", "-1"]) == 2
    assert "--older-than -1" in capsys.readouterr().err
    assert main(["gc", "--live-jobs", "1", "--wait", "nan"]) == 2
    assert "--wait nan" in capsys.readouterr().err
    missing = tmp_path / "none"
    assert main(["gc", "--live-jobs-file", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["gc", "--live-jobs", "1", "--live-jobs-file", str(missing)])
    assert exited.value.code == 2


def test_an_unreachable_broker_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As every control-plane command: the broker named, exit 1."""
    for name in list(os.environ):
        if name.startswith("IMEXD_"):
            monkeypatch.delenv(name)
    url = f"mqtt://127.0.0.1:{free_port()}"
    monkeypatch.setenv("IMEXD_BUS_URL", url)
    assert main(["gc", "--live-jobs", "1"]) == 1
    assert f"cannot connect to {url}" in capsys.readouterr().err


async def test_tombstones_older_than_the_given_age_are_cleared(
    broker: Mosquitto, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tombstones S lists the tombstones written more than S seconds ago; --apply clears
    them, and leaves younger tombstones and live records alone."""
    now = time.time()
    old = DomainSpec(domain="d-old", state="deleted", generation=3, at=now - 7200)
    young = DomainSpec(domain="d-new", state="deleted", generation=3, at=now)
    await put(
        broker,
        {
            T.spec("d-old"): encode(old),
            T.spec("d-new"): encode(young),
            T.spec("live"): spec("live"),
        },
    )
    assert await gc("--tombstones", "3600") == 0
    assert f"tombstone {T.spec('d-old')}" in capsys.readouterr().out
    assert T.spec("d-old") in await retained(broker)
    assert await gc("--tombstones", "3600", "--apply") == 0
    got = await retained(broker)
    assert T.spec("d-old") not in got
    assert T.spec("d-new") in got
    assert T.spec("live") in got
