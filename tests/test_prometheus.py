"""Alerting and dashboards as code, checked offline.

The alert rules (config/prometheus/imexd-rules.yaml) pass `promtool check rules` and
their unit tests (`promtool test rules`, every alert firing and not firing); every query
of the Grafana dashboard passes the same promtool check as a recording rule; every
metric name in the rules, their annotations' queries and the dashboard is one the agent
exports (read from a real exposition of `Metrics` fed with typical facts and their
conditions), and every imexd_condition type and reason they select is a real one; the
Prometheus Operator objects in config/kubernetes match the CRD fields they use, select
the DaemonSet's pods and carry the same rule groups.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from imexd.facts import (
    BusFacts,
    ChannelFacts,
    ChannelState,
    DaemonFacts,
    Facts,
    Member,
    MembershipFacts,
)
from imexd.health import conditions as health
from imexd.health.http import PATHS
from imexd.health.metrics import Metrics
from imexd.messages import CONDITION_TYPES

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "config" / "prometheus" / "imexd-rules.yaml"
RULE_TESTS = ROOT / "config" / "prometheus" / "imexd-rules.test.yaml"
DASHBOARD = ROOT / "config" / "grafana" / "imexd-dashboard.json"
PODMONITOR = ROOT / "config" / "kubernetes" / "podmonitor.yaml"
PROMETHEUSRULE = ROOT / "config" / "kubernetes" / "prometheusrule.yaml"
DAEMONSET = ROOT / "config" / "kubernetes" / "daemonset.yaml"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
MONITORING = ROOT / "docs" / "monitoring.md"

PROMTOOL = shutil.which("promtool") or (
    "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
)
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install prometheus; scripts/test does)",
)

SCRAPE_SERIES = frozenset({"up"})
"""Series that Prometheus itself adds to every target, not the agent."""
DASHBOARD_VARIABLES = {
    "domain": "train",
    "node": "gpu-01",
    "__rate_interval": "2m",
    "__interval": "1m",
    "__range": "6h",
}
"""Literal stand-ins for the dashboard's template variables and Grafana's built-ins."""
PROMQL_WORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
    | {"bool", "offset", "inf", "nan"}
)
SEVERITIES = frozenset({"critical", "warning"})

Doc = dict[str, Any]


def load_yaml(path: Path) -> Doc:
    with path.open() as fh:
        doc = yaml.safe_load(fh)
    assert isinstance(doc, dict), f"{path}: expected one mapping"
    return doc


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def alerts(groups: list[Doc]) -> Iterator[Doc]:
    for group in groups:
        yield from (rule for rule in group["rules"] if "alert" in rule)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not functions,
    keywords, label names (inside braces or after by/on/...), strings or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = re.sub(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # label lists
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group()
        after = text[match.end() :].lstrip()
        if word.lower() in PROMQL_WORDS or after.startswith("("):
            continue
        names.add(word)
    return names


def exported_names() -> set[str]:
    """The sample names of a real exposition, with every series family present."""
    metrics = Metrics()
    members = {0: Member("gpu-01", "10.0.0.11"), 1: Member("gpu-02", "10.0.0.12")}
    facts = Facts(
        node="gpu-01",
        domain="train",
        clique="c1",
        slot=0,
        bus=BusFacts(connected=True, synced=True, reconnects=1, dropped={"schema": 1}),
        membership=MembershipFacts(state="member", members=members),
        daemon=DaemonFacts(state="RUNNING", pid=4242, restarts=1, reloads=3, imex_status="READY"),
        channels=ChannelFacts(
            synced=True,
            count=2048,
            major=242,
            workloads=(ChannelState(workload="job-1", channel=1, generation=1, ready=True),),
            operations={("mknod", "ok"): 1},
        ),
    )
    metrics.update_from(facts, health.conditions(facts, [], 0.0))
    metrics.observe_reconcile(0.02)
    metrics.count_write("hosts", ok=False)
    metrics.count_probe_failure("local")
    metrics.count_task_failure("bus")
    text = metrics.render().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def annotation_queries(rule: Doc) -> list[str]:
    """The expressions that an alert's annotations query (`printf "EXPR" ... | query`)."""
    text = " ".join(rule.get("annotations", {}).values())
    return re.findall(r'printf "((?:[^"\\]|\\.)*)"[^}]*\|\s*query', text)


def condition_matchers(expr: str) -> Iterator[tuple[str, str]]:
    """(label, value) of each `type` and `reason` that an imexd_condition selector matches,
    a regex alternative split into its values; quotes single or double."""
    for selector in re.findall(r"imexd_condition\{([^}]*)\}", expr):
        for label, values in re.findall(
            r"\b(type|reason)\s*(?:=~|!~|!=|=)\s*[\"']([^\"']*)[\"']", selector
        ):
            for value in values.split("|"):
                yield label, value


def documented_reasons() -> set[str]:
    """The reasons in the first column of troubleshooting.md's condition tables."""
    cells = re.findall(r"^\| ([^|]*`[^|]*)\|", TROUBLESHOOTING.read_text(), re.MULTILINE)
    return {name for cell in cells for name in re.findall(r"`(\w+)`", cell)}


def dashboard() -> Doc:
    with DASHBOARD.open() as fh:
        doc = json.load(fh)
    assert isinstance(doc, dict)
    return doc


def panels(doc: Doc) -> Iterator[Doc]:
    for panel in doc["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(doc: Doc) -> list[tuple[str, str]]:
    """(where, expression) of every panel target and query variable."""
    out = [
        (f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"])
        for p in panels(doc)
        for t in p.get("targets", [])
    ]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            assert inner, f"variable {var['name']}: expected label_values(SELECTOR, LABEL)"
            out.append((f"variable {var['name']}", inner.group(1)))
    return out


def literal(expr: str, variables: dict[str, str] = DASHBOARD_VARIABLES) -> str:
    """`expr` with each template variable replaced by its literal stand-in."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in variables, f"unknown dashboard variable ${name} in {expr!r}"
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


# Rules


@needs_promtool
def test_rules_pass_promtool_check() -> None:
    """`promtool check rules` accepts the alert rules."""
    result = promtool("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_rules_unit_tests_pass() -> None:
    """`promtool test rules` runs the unit tests of every alert and they pass."""
    result = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_every_alert_has_a_unit_test() -> None:
    """Each alert appears in the unit tests both firing and, at some time, not firing."""
    tests = load_yaml(RULE_TESTS)["tests"]
    evals = [e for case in tests for e in case.get("alert_rule_test", [])]
    for rule in alerts(load_yaml(RULES)["groups"]):
        name = rule["alert"]
        mine = [e for e in evals if e["alertname"] == name]
        assert any(e["exp_alerts"] for e in mine), f"{name}: no test where it fires"
        assert any(not e["exp_alerts"] for e in mine), f"{name}: no test where it stays quiet"


@needs_promtool
def test_a_broken_unit_test_fails(tmp_path: Path) -> None:
    """promtool test rules fails on a wrong expectation, so the run above is not blind."""
    shutil.copy(RULES, tmp_path / RULES.name)
    tests = load_yaml(RULE_TESTS)
    case = tests["tests"][0]
    firing = next(e for e in case["alert_rule_test"] if e["exp_alerts"])
    firing["exp_alerts"] = []
    (tmp_path / RULE_TESTS.name).write_text(yaml.safe_dump(tests))
    result = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert firing["alertname"] in result.stdout + result.stderr


def test_alerts_carry_severity_and_annotations() -> None:
    """Every alert has a known severity, a summary, a description and a runbook_url; alerts
    joined with imexd_info name both the node and the domain."""
    for rule in alerts(load_yaml(RULES)["groups"]):
        name = rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= notes.keys(), name
        if "group_left (node, domain" in rule["expr"]:
            text = notes["summary"] + notes["description"]
            assert "$labels.node" in text, f"{name}: the node is not named"
            assert "$labels.domain" in text, f"{name}: the domain is not named"


def test_runbook_urls_point_at_troubleshooting_anchors() -> None:
    """Each runbook_url is docs/troubleshooting.md#ANCHOR for a heading that exists."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", TROUBLESHOOTING.read_text(), re.MULTILINE)
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    for rule in alerts(load_yaml(RULES)["groups"]):
        url = rule["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page == "docs/troubleshooting.md", f"{rule['alert']}: {url}"
        assert anchor in anchors, f"{rule['alert']}: no heading for #{anchor} in {TROUBLESHOOTING}"


def test_every_alert_is_documented() -> None:
    """docs/monitoring.md has a row for each alert, and none for an alert that is gone."""
    documented = set(re.findall(r"^\| `(Imexd\w+)` \|", MONITORING.read_text(), re.MULTILINE))
    assert documented == {rule["alert"] for rule in alerts(load_yaml(RULES)["groups"])}


def test_metric_names_are_parsed_from_expressions() -> None:
    """The name parser keeps metric names and drops functions, keywords, labels, ranges."""
    expr = (
        'sum by (le) (rate(imexd_reconcile_seconds_bucket{job="a"}[5m])) * on (job, instance)'
        " group_left (node) max by (job) (last_over_time(imexd_info[1d])) or (up == 0)"
    )
    assert metric_names(expr) == {"imexd_reconcile_seconds_bucket", "imexd_info", "up"}


def test_rules_use_only_exported_metrics() -> None:
    """Every metric name in the rules is in the agent's /metrics (or is Prometheus' `up`)."""
    known = exported_names() | SCRAPE_SERIES
    groups = load_yaml(RULES)["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        unknown = metric_names(rule["expr"]) - known
        assert not unknown, f"{rule.get('alert', rule.get('record'))}: not exported: {unknown}"


def test_annotation_queries_use_only_exported_metrics() -> None:
    """The series an annotation queries for its wording are in the agent's /metrics too."""
    known = exported_names() | SCRAPE_SERIES
    queried = [
        (r["alert"], q) for r in alerts(load_yaml(RULES)["groups"]) for q in annotation_queries(r)
    ]
    assert any("imexd_condition" in q for _, q in queried), "the parser found no query"
    for name, query in queried:
        unknown = metric_names(query) - known
        assert not unknown, f"{name}: its annotations query {unknown}, not exported"


def test_condition_types_and_reasons_are_real() -> None:
    """Every condition type that a rule or dashboard query selects is one of CONDITION_TYPES,
    and every reason one that troubleshooting.md explains."""
    rules = list(alerts(load_yaml(RULES)["groups"]))
    exprs = [r["expr"] for r in rules] + [q for r in rules for q in annotation_queries(r)]
    exprs += [e for _, e in dashboard_queries(dashboard())]
    matched = [m for e in exprs for m in condition_matchers(e)]
    assert {label for label, _ in matched} == {"type", "reason"}, matched
    reasons = documented_reasons()
    assert {"PublishRefused", "NodeMapMismatch", "ChannelConflict"} <= reasons
    for label, value in matched:
        known = set(CONDITION_TYPES) if label == "type" else reasons
        assert value in known, f"imexd_condition {label} {value!r} is not a real one"


def test_condition_matchers_are_parsed() -> None:
    """The matcher parser reads both quotes, regex alternatives and negations, and only
    inside imexd_condition selectors."""
    expr = (
        'imexd_condition{type=~"SlotSettled|DaemonReady", reason!="Ready"}'
        ' * on (job, instance) imexd_bus_dropped_total{reason="schema"}'
        " and imexd_condition{job='a',type='BusConnected'}"
    )
    assert list(condition_matchers(expr)) == [
        ("type", "SlotSettled"),
        ("type", "DaemonReady"),
        ("reason", "Ready"),
        ("type", "BusConnected"),
    ]


# Dashboard


def test_dashboard_is_well_formed() -> None:
    """Panels have unique ids, every panel but rows has a query, and every target uses the
    dashboard's data source variable."""
    doc = dashboard()
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {ids}"
    names = {v["name"] for v in doc["templating"]["list"]}
    assert {"datasource", "domain", "node"} <= names
    for panel in panels(doc):
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_dashboard_covers_what_an_operator_reads() -> None:
    """The dashboard shows domain state, readiness, the conditions that are not True with
    their reasons, restarts, reloads, the bus link, drops, channels per workload and the
    reconcile latency histogram."""
    used = set().union(*(metric_names(literal(e)) for _, e in dashboard_queries(dashboard())))
    assert {
        "imexd_domain_state",
        "imexd_ready",
        "imexd_daemon_restarts_total",
        "imexd_daemon_reloads_total",
        "imexd_bus_connected",
        "imexd_bus_dropped_total",
        "imexd_channel_ready",
        "imexd_condition",
        "imexd_reconcile_seconds_bucket",
    } <= used


def test_every_per_node_query_joins_imexd_info() -> None:
    """Series carry no node label of their own (docs/monitoring.md: a target label `node`
    would clash with imexd_info's), so every rule and dashboard query of an imexd series
    joins imexd_info for its node and domain: none reads without a node name."""
    rules = list(alerts(load_yaml(RULES)["groups"]))
    exprs = [(str(r["alert"]), r["expr"]) for r in rules]
    exprs += [(where, literal(e)) for where, e in dashboard_queries(dashboard())]
    for where, expr in exprs:
        names = metric_names(expr)
        if any(n.startswith("imexd_") and n != "imexd_info" for n in names):
            assert "imexd_info" in names, f"{where}: no join on imexd_info: {expr}"


def test_dashboard_uses_only_exported_metrics() -> None:
    """Every metric name in the dashboard's queries is in the agent's /metrics."""
    known = exported_names() | SCRAPE_SERIES
    for where, expr in dashboard_queries(dashboard()):
        unknown = metric_names(literal(expr)) - known
        assert not unknown, f"{where}: not exported: {unknown}"


@needs_promtool
def test_dashboard_queries_pass_promtool(tmp_path: Path) -> None:
    """Each dashboard query, variables replaced by literals, passes `promtool check rules`
    as a recording rule; a broken one is reported with its panel."""
    queries = dashboard_queries(dashboard())
    rules = [
        {"record": f"imexd:dashboard:{i}", "expr": literal(e)} for i, (_, e) in enumerate(queries)
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", path)
    if result.returncode != 0:
        bad = re.findall(r'"imexd:dashboard:(\d+)"', result.stdout + result.stderr)
        where = [queries[int(i)][0] for i in bad]
        pytest.fail(f"{where}: {result.stdout}{result.stderr}")
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


@needs_promtool
def test_promtool_catches_a_broken_query(tmp_path: Path) -> None:
    """The check above is not blind: an unbalanced query fails it."""
    path = tmp_path / "broken.yaml"
    rule = {"record": "imexd:broken", "expr": "sum(rate(imexd_bus_dropped_total[5m])"}
    path.write_text(yaml.safe_dump({"groups": [{"name": "broken", "rules": [rule]}]}))
    assert promtool("check", "rules", path).returncode != 0


def test_unknown_dashboard_variable_is_refused() -> None:
    """A query using a variable without a stand-in fails the check, naming the variable."""
    with pytest.raises(AssertionError, match=r"\$cluster"):
        literal('imexd_ready{cluster="$cluster"}')


# Prometheus Operator objects

_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}
_RELABEL = {
    "type": "object",
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {"type": "string"},
    },
    "additionalProperties": False,
}
_DURATION = {"type": "string", "pattern": r"^(0|(\d+(ms|s|m|h|d|w|y))+)$"}
PODMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "selector": {
                    "type": "object",
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                        "matchExpressions": {"type": "array"},
                    },
                    "additionalProperties": False,
                },
                "namespaceSelector": {
                    "type": "object",
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                    "additionalProperties": False,
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array", "items": _RELABEL},
                            "metricRelabelings": {"type": "array", "items": _RELABEL},
                        },
                        "additionalProperties": False,
                    },
                },
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}
"""The PodMonitor fields this project uses, as the monitoring.coreos.com/v1 CRD types them."""
_RULE = {
    "type": "object",
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}
PROMETHEUSRULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "limit": {"type": "integer"},
                            "partial_response_strategy": {"type": "string"},
                            "rules": {"type": "array", "items": _RULE},
                        },
                        "additionalProperties": False,
                    },
                }
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}
"""The PrometheusRule fields, as the monitoring.coreos.com/v1 CRD types them."""


@pytest.mark.parametrize(
    ("path", "schema"),
    [(PODMONITOR, PODMONITOR_SCHEMA), (PROMETHEUSRULE, PROMETHEUSRULE_SCHEMA)],
    ids=["podmonitor", "prometheusrule"],
)
def test_operator_object_matches_its_crd_fields(path: Path, schema: Doc) -> None:
    """The manifest holds one object whose fields are the CRD's (unknown fields refused)."""
    with path.open() as fh:
        docs = [d for d in yaml.safe_load_all(fh) if d]
    assert len(docs) == 1, f"{path}: expected one object"
    jsonschema.validate(docs[0], schema)


def test_the_crd_schema_catches_a_misspelt_field() -> None:
    """A misspelt field is refused, so the check above is not blind."""
    doc = load_yaml(PODMONITOR)
    doc["spec"]["podMetricEndpoints"] = doc["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError, match="podMetricEndpoints"):
        jsonschema.validate(doc, PODMONITOR_SCHEMA)


def test_podmonitor_scrapes_the_daemonset_agents() -> None:
    """The PodMonitor selects the DaemonSet's pods in its namespace, on the agent's named
    health port, at the agent's /metrics path."""
    monitor = load_yaml(PODMONITOR)
    daemonset = load_yaml(DAEMONSET)
    template = daemonset["spec"]["template"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    assert daemonset["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    agent = next(c for c in template["spec"]["containers"] if c["name"] == "imexd")
    ports = {p["name"] for p in agent["ports"]}
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in ports, f"no container port named {endpoint['port']}"
        assert endpoint["path"] in PATHS
        assert endpoint["path"] == "/metrics"


def test_prometheusrule_carries_the_rules_file() -> None:
    """The PrometheusRule's spec.groups are imexd-rules.yaml's groups, as data."""
    assert load_yaml(PROMETHEUSRULE)["spec"]["groups"] == load_yaml(RULES)["groups"]


@needs_promtool
def test_prometheusrule_groups_pass_promtool(tmp_path: Path) -> None:
    """`promtool check rules` accepts the PrometheusRule's groups."""
    groups = copy.deepcopy(load_yaml(PROMETHEUSRULE)["spec"]["groups"])
    path = tmp_path / "prometheusrule-groups.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


# The dashboard against live agents (issue 25): every panel shows data on a fleet as it is,
# not only after the events its counters count.

LIVE_JOB = "imexd"


def _series_line(name: str, labels: dict[str, str], instance: str) -> str:
    """A promtool input series: `name{label="value",...}` with the scrape's own labels."""
    every = {**labels, "job": LIVE_JOB, "instance": instance}
    quoted = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in sorted(every.items())
    )
    return f"{name}{{{quoted}}}"


def _scraped(text: str, instance: str) -> dict[str, float]:
    """Each sample of one /metrics text, as its promtool series line."""
    return {
        _series_line(s.name, dict(s.labels), instance): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@needs_promtool
@pytest.mark.timeout(180)
def test_every_panel_shows_data_against_live_agents(tmp_path: Path) -> None:
    """Two `imexd run` agents (simulated daemons) in domain d1, n1 serving a workload's
    channel, n2's daemon in a crash loop (so the panel of conditions that are not True
    has something to show): /metrics scraped twice from each, a minute apart as promtool
    sees it, and every dashboard query, variables set to n1's domain and any node, must
    return at least one series. Counters initialised at 0 count as data."""
    from tests.cluster import Cluster

    cluster = Cluster(tmp_path / "fleet")
    try:
        n1 = cluster.add("n1", domain="d1")
        broken = {"imex": {"env": {"IMEXD_SIM_EXIT_AFTER_S": "0.05", "IMEXD_SIM_EXIT_CODE": "3"}}}
        n2 = cluster.add("n2", domain="d1", overrides=broken)
        cluster.wait(n1.ready, timeout=60)
        created = cluster.imexd("workload", "create", "job-1", "--domain", "d1", "--nodes", "n1")
        assert created.returncode == 0, created.stdout + created.stderr
        cluster.wait(lambda: n2.status().get("daemon", {}).get("state") == "FATAL", timeout=60)
        scrapes: list[dict[str, float]] = []
        for _ in range(2):
            merged: dict[str, float] = {}
            for node in (n1, n2):
                code, body = node.get("/metrics")
                assert code == 200
                merged |= _scraped(body, node.name)
                merged[_series_line("up", {}, node.name)] = 1.0
            scrapes.append(merged)
            time.sleep(1.0)
    finally:
        cluster.close()
    variables = {**DASHBOARD_VARIABLES, "domain": "d1", "node": ".*"}
    queries = dashboard_queries(dashboard())
    result = _evaluate(scrapes, [literal(e, variables) for _, e in queries], tmp_path)
    empty = [w for (w, e) in queries if f"count({literal(e, variables)})" in result.stdout]
    assert result.returncode == 0, f"queries with no data: {empty}\n{result.stdout[-3000:]}"


@needs_promtool
def test_the_live_panel_check_is_not_blind(tmp_path: Path) -> None:
    """A query that matches nothing in the scrapes fails the check above."""
    scrapes = [{_series_line("imexd_ready", {}, "n1"): 1.0}] * 2
    assert _evaluate(scrapes, ["imexd_ready"], tmp_path).returncode == 0
    assert _evaluate(scrapes, ['imexd_ready{instance="n9"}'], tmp_path).returncode != 0


def _evaluate(
    scrapes: list[dict[str, float]], queries: list[str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """promtool's verdict on whether each query returns a series, the scrapes given one
    minute apart, evaluated at the second."""
    series = sorted({s for scrape in scrapes for s in scrape})
    inputs = [
        {"series": s, "values": " ".join(_value(scrape.get(s)) for scrape in scrapes)}
        for s in series
    ]
    tests = [
        {
            "expr": f"count({q}) > bool 0",
            "eval_time": "1m",
            "exp_samples": [{"labels": "{}", "value": 1}],
        }
        for q in queries
    ]
    path = tmp_path / "live.yaml"
    doc = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": tests}],
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return promtool("test", "rules", path)


def _value(value: float | None) -> str:
    """A sample as promtool's series notation writes it (`_`: not scraped that time)."""
    if value is None:
        return "_"
    return "NaN" if math.isnan(value) else repr(value)
