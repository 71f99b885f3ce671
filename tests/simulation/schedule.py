"""Fault schedules, generated from a seed: the nodes, the broker's kind, and a few dozen
timed steps (starts, crashes and restarts, leaves, network cuts, broker restarts, slow
deliveries, and a hostile writer's records).

`valid` keeps a schedule meaningful when steps are cut from it (`shrink`): a step about
a node that is not running at that moment, a start of one that is, and a record placed
other than before a node's first join are left out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from imexd.bus.events import Protocol
from tests.simulation.timings import BROKER_DOWN_MAX_S, LINK_DOWN_MAX_S, QUIET_S, SLOW_MAX_S

Kind = Literal["start", "crash", "leave", "cut", "broker", "slow", "replay", "forge", "place"]
HOSTILE: frozenset[Kind] = frozenset({"replay", "forge", "place"})
Form = Literal["member", "claiming", "standby", "lost"]
FORMS: tuple[Form, ...] = ("member", "claiming", "standby", "lost")

_WEIGHTS: dict[Kind, float] = {
    "start": 3.0,
    "crash": 2.5,
    "leave": 1.0,
    "cut": 2.5,
    "broker": 1.0,
    "slow": 1.0,
    "replay": 1.0,
    "forge": 1.0,
    "place": 0.5,
}


@dataclass(frozen=True, slots=True)
class Step:
    """One fault or event at `at` seconds."""

    at: float
    kind: Kind
    node: str = ""
    span_s: float = 0.0
    """How long it lasts: a cut's or a broker restart's downtime, a slow spell."""
    extra_s: float = 0.0
    """A slow spell's most added delay."""
    empty: bool = False
    """A broker restart loses its retained records."""
    form: Form = "member"
    """What a forged or placed record says."""
    pick: int = 0
    """A seeded choice made when the step runs (which old record, which slot, ...)."""

    def __str__(self) -> str:
        text = f"t={self.at:8.3f} {self.kind}"
        if self.node:
            text += f" {self.node}"
        if self.kind == "broker":
            text += f" {'empty' if self.empty else 'persisted'} down {self.span_s:.2f} s"
        elif self.kind == "cut":
            text += f" for {self.span_s:.2f} s"
        elif self.kind == "slow":
            text += f" by up to {self.extra_s:.2f} s for {self.span_s:.2f} s"
        elif self.kind in ("forge", "place"):
            text += f" {self.form} (pick {self.pick})"
        elif self.kind == "replay":
            text += f" (pick {self.pick})"
        return text


@dataclass(frozen=True, slots=True)
class Schedule:
    """Everything a seed fixes for one run."""

    seed: int
    nodes: tuple[str, ...]
    max_nodes: int
    protocol: Protocol
    takeover_will: bool
    persist_wills: bool
    spike_p: float
    skews: tuple[float, ...]
    steps: tuple[Step, ...]

    @property
    def end(self) -> float:
        """When the run ends: the quiet period after the last step is over."""
        last = max((s.at + s.span_s for s in self.steps), default=0.0)
        return last + QUIET_S

    def describe(self) -> str:
        return (
            f"seed {self.seed}: {len(self.nodes)} nodes, max_nodes {self.max_nodes}, "
            f"MQTT {self.protocol}"
            + (", 3.1.1 take-over publishes the old will" if self.takeover_will else "")
            + (", restarts persist the shutdown's wills" if self.persist_wills else "")
            + f", late deliveries {self.spike_p:.0%}"
        )


def generate(seed: int) -> Schedule:
    """The schedule of `seed`."""
    rng = random.Random(seed)
    count = rng.randint(2, 6)
    names = tuple(f"n{i}" for i in range(1, count + 1))
    max_nodes = min(18, count + rng.choice((0, 0, 1, 2, 4)))
    protocol: Protocol = "5" if rng.random() < 0.7 else "3.1.1"
    steps: list[Step] = []
    first = rng.sample(names, rng.randint(1, count))
    steps += [Step(rng.uniform(0.0, 0.3), "start", name) for name in first]
    alive, started = set(first), set(first)
    at = 0.3
    for _ in range(rng.randint(4, 20)):
        at += _gap(rng)
        kinds = [k for k in _WEIGHTS if _possible(k, alive, started, names)]
        kind = rng.choices(kinds, weights=[_WEIGHTS[k] for k in kinds])[0]
        step, later = _step(rng, kind, at=at, alive=alive, started=started, names=names)
        steps.append(step)
        if later is not None:
            steps.append(later)
    return Schedule(
        seed=seed,
        nodes=names,
        max_nodes=max_nodes,
        protocol=protocol,
        takeover_will=rng.random() < 0.5,
        persist_wills=rng.random() < 0.5,
        spike_p=rng.choice((0.0, 0.01, 0.05, 0.2)),
        skews=tuple(rng.uniform(-0.5, 0.5) for _ in names),
        steps=valid(steps),
    )


def _gap(rng: random.Random) -> float:
    """Time to the next step: often nearly at once (faults that overlap), often later."""
    roll = rng.random()
    if roll < 0.35:
        return rng.uniform(0.0, 0.05)
    if roll < 0.7:
        return rng.uniform(0.05, 1.5)
    return rng.uniform(1.5, 10.0)


def _possible(kind: Kind, alive: set[str], started: set[str], names: tuple[str, ...]) -> bool:
    if kind == "start":
        return len(alive) < len(names)
    if kind == "place":
        return len(started) < len(names)
    return bool(alive)


def _step(
    rng: random.Random,
    kind: Kind,
    *,
    at: float,
    alive: set[str],
    started: set[str],
    names: tuple[str, ...],
) -> tuple[Step, Step | None]:
    """One step of `kind` (and for a placed record, the start it precedes)."""
    pick = rng.randrange(1 << 30)
    if kind == "broker":
        return Step(
            at, kind, span_s=rng.uniform(0.1, BROKER_DOWN_MAX_S), empty=rng.random() < 0.5
        ), None
    if kind == "start":
        node = rng.choice(sorted(set(names) - alive))
        alive.add(node)
        started.add(node)
        return Step(at, kind, node), None
    if kind == "place":
        node = rng.choice(sorted(set(names) - started))
        alive.add(node)
        started.add(node)
        return (
            Step(at, kind, node, form=rng.choice(FORMS), pick=pick),
            Step(at + rng.uniform(0.0, 3.0), "start", node),
        )
    node = rng.choice(sorted(alive))
    if kind in ("crash", "leave"):
        alive.discard(node)
        return Step(at, kind, node), None
    if kind == "cut":
        return Step(at, kind, node, span_s=rng.uniform(0.05, LINK_DOWN_MAX_S)), None
    if kind == "slow":
        return Step(
            at, kind, node, span_s=rng.uniform(0.5, 6.0), extra_s=rng.uniform(0.05, SLOW_MAX_S)
        ), None
    return Step(at, kind, node, form=rng.choice(FORMS), pick=pick), None


def valid(steps: list[Step] | tuple[Step, ...]) -> tuple[Step, ...]:
    """The steps in time order, less those that mean nothing where they stand."""
    ordered = sorted(steps, key=lambda s: s.at)
    alive: set[str] = set()
    started: set[str] = set()
    kept: list[Step] = []
    for index, step in enumerate(ordered):
        node = step.node
        if step.kind == "start":
            if node in alive:
                continue
            alive.add(node)
            started.add(node)
        elif step.kind in ("crash", "leave"):
            if node not in alive:
                continue
            alive.discard(node)
        elif step.kind == "place":
            joins = any(s.kind == "start" and s.node == node for s in ordered[index + 1 :])
            if node in started or not joins:
                continue
        elif step.kind != "broker" and node not in alive:
            continue
        kept.append(step)
    return tuple(kept)
