"""The Prometheus text format written by hand (`imexd.health.exposition`), read back with
`prometheus_client`'s own parser: what any label value or help text becomes must parse
to itself, and a node named to break the format cannot forge or hide a series."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from imexd.health.exposition import Counters, Family, Histogram, counter, gauge, render


def parsed(*families: Family) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    text = render(families).decode()
    return {
        f.name: [(s.name, dict(s.labels), s.value) for s in f.samples]
        for f in text_string_to_metric_families(text)
    }


@given(
    value=st.text(st.characters(codec="utf-8"), max_size=40),
    help_text=st.text(st.characters(codec="utf-8"), max_size=40),
)
def test_any_label_value_and_help_text_read_back_as_written(value: str, help_text: str) -> None:
    info = gauge("imexd_info", help_text, labels=["node", "version"])
    info.add([value, "1"], 1.0)
    families = parsed(info, gauge("imexd_ready", "after", 1.0))
    assert families["imexd_info"] == [("imexd_info", {"node": value, "version": "1"}, 1.0)]
    assert families["imexd_ready"] == [("imexd_ready", {}, 1.0)]  # nothing forged or hidden


def test_a_node_name_made_to_break_the_format_stays_one_label_value() -> None:
    name = 'n1"} 1\nimexd_ready 0\n# \\'
    info = gauge("imexd_info", "who", labels=["node"])
    info.add([name], 1.0)
    families = parsed(info)
    assert families == {"imexd_info": [("imexd_info", {"node": name}, 1.0)]}


def test_counters_histograms_and_special_values_are_what_prometheus_reads() -> None:
    writes = Counters("imexd_file_writes", "Files written.", ["file"])
    writes.show("hosts")
    writes.inc("state", amount=2)
    once = Counters("imexd_broker_rebuilds", "Rebuilds.")
    once.inc()
    seconds = Histogram("imexd_reconcile_seconds", "Seconds.", (0.01, 0.1))
    for v in (0.005, 0.05, 5.0):
        seconds.observe(v)
    odd = gauge("imexd_odd", "Special values.", labels=["v"])
    for label, v in (("inf", math.inf), ("-inf", -math.inf), ("big", 1e20)):
        odd.add([label], v)
    families = parsed(writes.family(), once.family(), seconds.family(), odd, counter("c", "x", 3))
    assert families["imexd_file_writes"] == [
        ("imexd_file_writes_total", {"file": "hosts"}, 0.0),
        ("imexd_file_writes_total", {"file": "state"}, 2.0),
    ]
    assert families["imexd_broker_rebuilds"] == [("imexd_broker_rebuilds_total", {}, 1.0)]
    assert families["imexd_reconcile_seconds"] == [
        ("imexd_reconcile_seconds_bucket", {"le": "0.01"}, 1.0),
        ("imexd_reconcile_seconds_bucket", {"le": "0.1"}, 2.0),
        ("imexd_reconcile_seconds_bucket", {"le": "+Inf"}, 3.0),
        ("imexd_reconcile_seconds_count", {}, 3.0),
        ("imexd_reconcile_seconds_sum", {}, 5.055),
    ]
    assert families["imexd_odd"] == [
        ("imexd_odd", {"v": "inf"}, math.inf),
        ("imexd_odd", {"v": "-inf"}, -math.inf),
        ("imexd_odd", {"v": "big"}, 1e20),
    ]
    assert families["c"] == [("c_total", {}, 3.0)]
    nan = gauge("imexd_nan", "NaN.", math.nan)
    assert math.isnan(parsed(nan)["imexd_nan"][0][2])


def test_wrong_use_is_refused() -> None:
    writes = Counters("imexd_file_writes", "Files written.", ["file"])
    with pytest.raises(ValueError, match="1 label values expected"):
        writes.inc()
    with pytest.raises(ValueError, match="counters only go up"):
        writes.inc("hosts", amount=-1)
    with pytest.raises(ValueError, match="1 label values expected"):
        gauge("g", "h", labels=["a"]).add([], 1.0)
    assert render([]) == b""
