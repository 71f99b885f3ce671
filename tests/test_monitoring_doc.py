"""docs/monitoring.md's metric reference, checked against what an agent's `/metrics` serves.

Three readings must agree: the table in the page; a real scrape of `/metrics` from the
agent's HTTP server on a free loopback port, fed facts under which every family has a
sample (so its label names can be read); and the families declared in imexd's source
(every `gauge`, `counter`, `Counters` and `Histogram` of `imexd.health.exposition`
named `imexd_...`), which also finds a family that only some facts bring out. The alert
rules and the dashboard may only use metrics the table lists.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from imexd.facts import (
    BusFacts,
    ChannelFacts,
    ChannelState,
    Contest,
    DaemonFacts,
    Facts,
    Member,
    MembershipFacts,
)
from imexd.health.conditions import Health, Heartbeats
from imexd.health.http import HealthServer
from imexd.health.metrics import Metrics
from tests.test_prometheus import (
    RULES,
    SCRAPE_SERIES,
    annotation_queries,
    dashboard,
    dashboard_queries,
    literal,
    load_yaml,
    metric_names,
)

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "docs" / "monitoring.md"
PACKAGE = ROOT / "imexd"
REFERENCE_HEADING = "## Metric reference"

KINDS = {"gauge": "gauge", "counter": "counter", "Counters": "counter", "Histogram": "histogram"}
"""The exposition's constructors that declare a family, and the family's type."""
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
"""The sample names a family of each type is queried by, after its family name."""

MEMBERS = {0: Member("gpu-01", "127.0.0.1"), 1: Member("gpu-02", "127.0.0.2")}
EVERY_FAMILY = Facts(
    node="gpu-01",
    domain="train",
    clique="c1",
    address="127.0.0.1",
    slot=0,
    bus=BusFacts(connected=True, synced=True, reconnects=1, dropped={"schema": 1}),
    membership=MembershipFacts(
        state="member", members=MEMBERS, contested=(Contest(1, "gpu-02", ("gpu-09",)),)
    ),
    daemon=DaemonFacts(state="RUNNING", pid=4242, restarts=1, reloads=3, imex_status="READY"),
    channels=ChannelFacts(
        synced=True,
        count=2048,
        major=242,
        workloads=(ChannelState(workload="job-1", channel=1, generation=1, ready=True),),
        operations={("mknod", "ok"): 1},
    ),
)
"""A member node with a driver count and a workload: every family has a sample."""


@dataclass(frozen=True, slots=True)
class Metric:
    """One family as operators query it: counters by `<name>_total`."""

    name: str
    kind: str
    labels: frozenset[str]


def queried_name(family: str, kind: str) -> str:
    return f"{family}_total" if kind == "counter" else family


# The three readings


def documented(text: str) -> dict[str, Metric]:
    """The rows of the metric reference: `name` | type | labels (backticked, or none) |
    meaning; a duplicate or malformed row fails."""
    _, found, rest = text.partition(f"\n{REFERENCE_HEADING}\n")
    assert found, f"docs/monitoring.md has no {REFERENCE_HEADING!r} section"
    section = rest.split("\n## ", 1)[0]
    rows: dict[str, Metric] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"expected 4 cells (metric, type, labels, meaning): {line}"
        name_cell, kind, labels, meaning = cells
        name = re.fullmatch(r"`(imexd_\w+)`", name_cell)
        assert name, f"not one metric name in backticks: {name_cell!r}"
        assert kind in SUFFIXES, f"{name_cell}: unknown type {kind!r}"
        if labels == "none":
            names: frozenset[str] = frozenset()
        else:
            names = frozenset(re.findall(r"`(\w+)`", labels))
            assert names, f"{name_cell}: labels are `name`s or none, not {labels!r}"
        assert meaning, f"{name_cell}: no meaning"
        assert name.group(1) not in rows, f"{name_cell}: two rows"
        rows[name.group(1)] = Metric(name.group(1), kind, names)
    return rows


def declared(root: Path = PACKAGE) -> dict[str, Metric]:
    """Each family imexd's source declares: a call of an exposition constructor whose
    first argument is a literal `imexd_...` name, with its literal label names."""
    found: dict[str, Metric] = {}
    for path in sorted(root.rglob("*.py")):
        for call in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(call, ast.Call) or not call.args:
                continue
            func = call.func
            ctor = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            first = call.args[0]
            if ctor not in KINDS or not isinstance(first, ast.Constant):
                continue
            if not (isinstance(first.value, str) and first.value.startswith("imexd_")):
                continue
            kind = KINDS[ctor]
            given = [k.value for k in call.keywords if k.arg == "labels"]
            if ctor == "Counters" and len(call.args) > 2:
                given.append(call.args[2])
            labels = {"le"} if kind == "histogram" else set()
            for node in given:
                assert isinstance(node, ast.List | ast.Tuple), f"{path}: labels not literal"
                for item in node.elts:
                    assert isinstance(item, ast.Constant), f"{path}: label not literal"
                    labels.add(str(item.value))
            metric = Metric(queried_name(first.value, kind), kind, frozenset(labels))
            assert found.get(metric.name, metric) == metric, f"{metric.name} declared twice"
            found[metric.name] = metric
    return found


def served(text: str) -> dict[str, Metric]:
    """The families of an exposition, each with the label names its samples carry."""
    out: dict[str, Metric] = {}
    for family in text_string_to_metric_families(text):
        assert family.samples, (
            f"{family.name} has no sample in the scrape, so its labels cannot be read: "
            "give EVERY_FAMILY the facts that bring one out"
        )
        labels = frozenset(name for s in family.samples for name in s.labels)
        name = queried_name(family.name, family.type)
        out[name] = Metric(name, family.type, labels)
    return out


async def scrape(facts: Facts) -> str:
    """The body of GET /metrics from a real HealthServer on a free loopback port."""
    metrics = Metrics()
    metrics.count_task_failure("probe")
    metrics.observe_reconcile(0.02)
    server = HealthServer(
        "127.0.0.1:0", heartbeats=Heartbeats(), health=Health(facts), metrics=metrics
    )
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = await asyncio.wait_for(reader.read(), 5.0)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body.decode()


def differences(table: dict[str, Metric], truth: dict[str, Metric]) -> list[str]:
    """What the table gets wrong about `truth`: missing rows, rows of no real family,
    and rows whose type or labels differ."""
    problems = [f"{n}: served but not in the table" for n in sorted(truth.keys() - table.keys())]
    problems += [f"{n}: in the table, not served" for n in sorted(table.keys() - truth.keys())]
    for name in sorted(table.keys() & truth.keys()):
        row, real = table[name], truth[name]
        if row.kind != real.kind:
            problems.append(f"{name}: the table says {row.kind}, /metrics {real.kind}")
        if row.labels != real.labels:
            problems.append(
                f"{name}: the table's labels {sorted(row.labels)}, /metrics {sorted(real.labels)}"
            )
    return problems


def family_of(sample: str, table: dict[str, Metric]) -> str | None:
    """The table row that a sample name in a query belongs to (a histogram's `_bucket`)."""
    for row in table.values():
        base = row.name.removesuffix("_total")
        if sample in {base + suffix for suffix in SUFFIXES[row.kind]}:
            return row.name
    return None


def used_metrics() -> Iterator[tuple[str, str]]:
    """(where, metric name) of every series the alert rules and the dashboard select."""
    rules = load_yaml(RULES)["groups"]
    for rule in (r for g in rules for r in g["rules"]):
        where = str(rule.get("alert", rule.get("record")))
        for expr in [rule["expr"], *annotation_queries(rule)]:
            yield from ((where, n) for n in metric_names(expr))
    for where, expr in dashboard_queries(dashboard()):
        yield from ((where, n) for n in metric_names(literal(expr)))


# Tests


async def test_reference_matches_what_metrics_serves() -> None:
    """Every family a real /metrics serves has a row with its type and label names, and
    every row is a served family."""
    problems = differences(documented(MONITORING.read_text()), served(await scrape(EVERY_FAMILY)))
    assert not problems, "docs/monitoring.md's metric reference:\n" + "\n".join(problems)


async def test_every_declared_family_is_served() -> None:
    """The scrape above sees every family the source declares, with the same type and
    labels, so a family that only some facts bring out cannot slip past the table."""
    source = declared()
    assert {"imexd_bus_dropped_total", "imexd_reconcile_seconds"} <= source.keys()
    problems = differences(source, served(await scrape(EVERY_FAMILY)))
    assert not problems, "declared in imexd/ against the scrape:\n" + "\n".join(problems)


def test_rules_and_dashboard_use_only_documented_metrics() -> None:
    """Each metric an alert rule, an annotation's query or a dashboard panel selects is a
    row of the reference (or Prometheus' own `up`)."""
    table = documented(MONITORING.read_text())
    used = list(used_metrics())
    assert any(name == "imexd_reconcile_seconds_bucket" for _, name in used), "nothing parsed"
    unknown = [
        f"{where}: {name}"
        for where, name in used
        if name not in SCRAPE_SERIES and family_of(name, table) is None
    ]
    assert not unknown, "not in docs/monitoring.md's metric reference:\n" + "\n".join(unknown)


def test_a_wrong_table_is_caught() -> None:
    """A missing row, a row of no real family, a wrong type and wrong labels are each
    reported by name."""
    truth = {
        "imexd_a_total": Metric("imexd_a_total", "counter", frozenset({"reason"})),
        "imexd_b": Metric("imexd_b", "gauge", frozenset()),
        "imexd_c": Metric("imexd_c", "gauge", frozenset({"state"})),
    }
    text = "\n".join(
        [
            "# Monitoring",
            REFERENCE_HEADING,
            "| metric | type | labels | meaning |",
            "| --- | --- | --- | --- |",
            "| `imexd_a_total` | counter | `kind` | what it counts |",
            "| `imexd_b` | counter | none | a gauge called a counter |",
            "| `imexd_gone` | gauge | none | no longer served |",
            "## Next section",
            "| `imexd_c` | gauge | `state` | outside the reference |",
        ]
    )
    assert differences(documented(text), truth) == [
        "imexd_c: served but not in the table",
        "imexd_gone: in the table, not served",
        "imexd_a_total: the table's labels ['kind'], /metrics ['reason']",
        "imexd_b: the table says counter, /metrics gauge",
    ]


def test_declarations_are_read_from_source(tmp_path: Path) -> None:
    """The source reader finds each constructor's family with its type and literal labels,
    and skips names that are not imexd's."""
    (tmp_path / "m.py").write_text(
        "from imexd.health import exposition as x\n"
        "from imexd.health.exposition import Counters, Histogram, gauge\n"
        "g = gauge('imexd_g', 'h', labels=['state'])\n"
        "c = x.counter('imexd_c', 'h', 1.0)\n"
        "k = Counters('imexd_k', 'h', ['file'])\n"
        "h = Histogram('imexd_h', 'h', (1.0,))\n"
        "o = gauge('other_g', 'h')\n"
    )
    assert declared(tmp_path) == {
        "imexd_g": Metric("imexd_g", "gauge", frozenset({"state"})),
        "imexd_c_total": Metric("imexd_c_total", "counter", frozenset()),
        "imexd_k_total": Metric("imexd_k_total", "counter", frozenset({"file"})),
        "imexd_h": Metric("imexd_h", "histogram", frozenset({"le"})),
    }
