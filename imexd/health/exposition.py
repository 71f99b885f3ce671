"""The Prometheus text format (version 0.0.4), written by hand: what `/metrics` serves.

The agent exports a few dozen series; the format is a page of rules (HELP and TYPE
lines, one sample per line, escaped label values). `prometheus_client` would write the
same text, but importing it brings `http.server`, `urllib.request` and `email` into
every agent's memory, the largest share of the agent's own after asyncio and the MQTT
client (docs/performance.md). The tests read this output with `prometheus_client`'s
own parser, so what is written here is held to the reference reading.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Final, Literal

import msgspec

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
"""The Content-Type of the text format."""

Kind = Literal["counter", "gauge", "histogram"]


class Family(msgspec.Struct):
    """One metric family: its samples as (name suffix, (label, value) pairs, value)."""

    name: str
    help: str
    kind: Kind
    labels: tuple[str, ...] = ()
    samples: list[tuple[str, tuple[tuple[str, str], ...], float]] = msgspec.field(
        default_factory=list
    )

    def add(self, values: Sequence[str], value: float) -> None:
        """One sample with `values` for `labels` (a counter's is named `<name>_total`)."""
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: {len(self.labels)} label values expected")
        suffix = "_total" if self.kind == "counter" else ""
        self.samples.append((suffix, tuple(zip(self.labels, values, strict=True)), float(value)))


def gauge(
    name: str, help_text: str, value: float | None = None, *, labels: Sequence[str] = ()
) -> Family:
    """A gauge family; with `value`, its one unlabelled sample."""
    return _family("gauge", name, help_text, value, labels)


def counter(
    name: str, help_text: str, value: float | None = None, *, labels: Sequence[str] = ()
) -> Family:
    """A counter family (`name` without `_total`); with `value`, its one unlabelled sample."""
    return _family("counter", name, help_text, value, labels)


def _family(
    kind: Kind, name: str, help_text: str, value: float | None, labels: Sequence[str]
) -> Family:
    family = Family(name, help_text, kind, tuple(labels))
    if value is not None:
        family.add((), value)
    return family


class Counters:
    """Counters by label values, counted as things happen; pre-created values read 0."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.labels = name, help_text, tuple(labels)
        self.values: dict[tuple[str, ...], float] = {} if self.labels else {(): 0.0}

    def show(self, *values: str) -> None:
        """Show the series of `values` from 0."""
        self.values.setdefault(self._key(values), 0.0)

    def inc(self, *values: str, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up, not by {amount}")
        key = self._key(values)
        self.values[key] = self.values.get(key, 0.0) + amount

    def family(self) -> Family:
        family = Family(self.name, self.help, "counter", self.labels)
        for key, value in self.values.items():  # in the order first shown or counted
            family.add(key, value)
        return family

    def _key(self, values: Sequence[str]) -> tuple[str, ...]:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: {len(self.labels)} label values expected")
        return tuple(values)


class Histogram:
    """Observations in cumulative buckets, with their count and sum."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name, self.help, self.bounds = name, help_text, tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break

    def family(self) -> Family:
        family = Family(self.name, self.help, "histogram")
        total = 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            total += count
            family.samples.append(("_bucket", (("le", _number(bound)),), float(total)))
        family.samples.append(("_count", (), float(total)))
        family.samples.append(("_sum", (), self.sum))
        return family


def render(families: Iterable[Family]) -> bytes:
    """The text exposition of `families`, in their order."""
    lines: list[str] = []
    for f in families:
        named = f"{f.name}_total" if f.kind == "counter" else f.name  # as Prometheus writes it
        lines.append(f"# HELP {named} {_escape_help(f.help)}")
        lines.append(f"# TYPE {named} {f.kind}")
        for suffix, pairs, value in f.samples:
            labels = ",".join(f'{n}="{_escape_value(v)}"' for n, v in sorted(pairs))
            text = f"{{{labels}}}" if labels else ""
            lines.append(f"{f.name}{suffix}{text} {_number(value)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    """Go's formatting of a float, as Prometheus reads it: +Inf, -Inf, NaN, 1.0, 1e+20."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
