"""The control plane: `imexd domain ...` and `imexd node ...`, a CLI over the agents' bus.

Agents do all the work; the control plane only writes the two retained inputs they follow
(a domain's `DomainSpec` and each node's `Assignment`) and reads the two retained outputs
they publish (`MemberRecord`s and `HealthReport`s):

- `domain create NAME [--nodes a,b] [--max-nodes N]`: the spec (state `active`, generation
  one above the previous spec's), then an assignment for each listed node;
- `domain delete NAME [--timeout S]`: the spec in state `deleting`, a wait until no member
  record of NAME is left, then the assignments pointing at NAME, the spec and leftover
  health reports are cleared (see `delete` for what happens at the timeout);
- `domain list`, `domain status NAME [--json] [--watch] [--wait S]`: tables judged by the
  pure `judge` (UP / DEGRADED / DOWN / FORMING / UNKNOWN, see there);
- `node assign NODE DOMAIN`, `node unassign NODE`.

Exit codes: 0 success (for `status`: the domain is UP), 1 failure (broker unreachable, a
write the broker did not keep, members left at a delete's timeout, a domain not UP),
2 usage errors (a name that is not DNS-1123), 130 interrupted.

Why a direct aiomqtt `Link` and not `imexd.bus.Bus`: the commands are one-shot (connect,
read a snapshot, write, verify, leave), so Bus's reconnect loop and replayed desired state
would only hide an unreachable broker behind retries, where an operator wants a clear error
within seconds. And Bus proves its snapshot with a ping on `{p}/nodes/{node}/ping` with a
DNS-1123 `node`, while the shipped broker ACL grants ping topics per user (`%u`) and names
the control plane's user `imexd_control` (not a DNS-1123 name, on purpose), so a Bus-based
control plane would never sync there. The `Link` proves its snapshot the same way (an echo
of its own non-retained message, which the broker queues after every retained message of
the earlier subscriptions) on `{p}/domains/_control/sync/{client_id}`: readable and writable
under the shipped ACL's `{p}/domains/#` grant, and matched by no agent subscription (`_control`
is not a DNS-1123 label, so it is never a domain). The decoding is the agents' own
(`imexd.bus.decode_message`), so both sides drop the same malformed messages.

`python -m imexd.control --write-schemas docs/schemas` regenerates the shipped JSON Schemas
from `imexd.messages.json_schemas()`; `--check-schemas` fails when they differ.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self, TextIO

import aiomqtt
import msgspec
from paho.mqtt.reasoncodes import ReasonCode

from imexd import health as hl
from imexd.bus import (
    Deleted,
    Received,
    abort_client,
    decode_message,
    describe_error,
    discard_client,
    mqtt_client,
    protocol_versions,
    read_password,
    refuses_protocol,
    topic_matches,
)
from imexd.errors import BusError
from imexd.fleet import (
    DomainState,
    DomainStatus,
    DomainSummary,
    SeenReport,
    judge,
    render_list,
    render_status,
    status_json,
)
from imexd.messages import (
    Assignment,
    DomainSpec,
    Dropped,
    HealthReport,
    MemberRecord,
    Presence,
    Topics,
    encode,
    json_schemas,
)
from imexd.settings import (
    BrokerURL,
    BusSettings,
    Settings,
    is_dns1123_label,
    is_dns1123_subdomain,
    load_settings,
    parse_broker_url,
)

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

CONNECT_TIMEOUT_S: Final = 5.0
"""Bound on reaching a broker (TCP, TLS, CONNACK); each URL of `[bus] url` gets it."""
OPERATION_TIMEOUT_S: Final = 5.0
"""Bound on each broker round trip (SUBACK, PUBACK, the sync echo)."""
SEEN_WITHIN_S: Final = 600.0
"""`node assign --seen-within` default: an agent must have reported the node this recently."""
HEALTH_GRACE_S: Final = 2.0
"""After the members left, how long `delete` waits for their own health report clears
before it clears what is left itself (bounded by what is left of --timeout)."""
SYNC_LEVEL: Final = "_control"
"""Topic level under `{p}/domains/` for the sync echo: never a domain (not DNS-1123)."""
CONTROL_NAME: Final = "imexd-control"
"""Placeholder `[node] name` while loading settings: the control plane has no node, and a
host name that is not DNS-1123 must not make its settings invalid."""
SCHEMA_NAMES: Final = ("MemberRecord", "HealthReport", "DomainSpec", "Assignment", "Presence")


# Names.


def domain_problem(name: str) -> str | None:
    """None when `name` can name a domain, else a sentence saying why not."""
    if is_dns1123_label(name):
        return None
    return (
        f"domain name {name!r} is not a DNS-1123 label: lowercase letters, digits and '-', "
        "starting and ending with a letter or digit, at most 63 characters"
    )


def node_problem(name: str) -> str | None:
    """None when `name` can name a node, else a sentence saying why not."""
    if is_dns1123_subdomain(name):
        return None
    return (
        f"node name {name!r} is not a DNS-1123 subdomain: dot-separated labels of lowercase "
        "letters, digits and '-', at most 253 characters"
    )


def parse_nodes(text: str | None) -> tuple[list[str] | None, list[str]]:
    """`--nodes a,b,c` as a list (None when not given) and the problems with it."""
    if text is None:
        return None, []
    nodes = [part.strip() for part in text.split(",")]
    problems: list[str] = []
    if not any(nodes):
        return [], ["--nodes names no node"]
    if "" in nodes:
        problems.append(f"--nodes {text!r} has an empty name")
    problems.extend(p for n in nodes if n and (p := node_problem(n)) is not None)
    twice = sorted(n for n, count in Counter(nodes).items() if n and count > 1)
    if twice:
        problems.append(f"--nodes lists {', '.join(twice)} more than once")
    return [n for n in nodes if n], problems


def max_nodes_problem(value: int | None) -> str | None:
    """None when `--max-nodes` is absent or in 1..2048, else why not."""
    if value is None or 1 <= value <= 2048:
        return None
    return f"--max-nodes {value}: expected 1 to 2048 slots per clique"


def next_spec(
    previous: DomainSpec | None,
    name: str,
    *,
    nodes: list[str] | None,
    max_nodes: int | None,
    default_max_nodes: int,
) -> DomainSpec:
    """The spec `domain create` writes: exactly the given node list, state active.

    The generation grows by one over the previous spec's (1 for a new domain). Without
    `--max-nodes` the previous spec's value is kept (changing it would make every member
    report NodeMapMismatch), else the `[domain] max_nodes` setting is used.
    """
    if max_nodes is None:
        max_nodes = previous.max_nodes if previous is not None else default_max_nodes
    return DomainSpec(
        domain=name,
        nodes=nodes,
        max_nodes=max_nodes,
        state="active",
        generation=previous.generation + 1 if previous is not None else 1,
    )


# What the control plane saw on the bus.


@dataclass(slots=True)
class Store:
    """The latest retained state of the subscribed topics, by what it addresses."""

    specs: dict[str, DomainSpec] = field(default_factory=dict)
    members: dict[tuple[str, str, str], MemberRecord] = field(default_factory=dict)
    """(domain, clique, node) -> record."""
    reports: dict[tuple[str, str], SeenReport] = field(default_factory=dict)
    """(domain, node) -> report."""
    assignments: dict[str, str | None] = field(default_factory=dict)
    """node -> domain (None: an explicit null assignment)."""
    presences: dict[str, Presence] = field(default_factory=dict)
    """node -> the agent's retained presence record."""
    dropped: Counter[str] = field(default_factory=Counter)
    """Malformed messages ignored, by `messages.DropReason` value."""

    def apply(self, event: Received | Deleted, *, expires_at: float | None = None) -> None:
        """Take one decoded message (an empty payload deletes)."""
        ref = event.ref
        payload = event.payload if isinstance(event, Received) else None
        match ref.kind:
            case "spec":
                if isinstance(payload, DomainSpec):
                    self.specs[ref.domain] = payload
                else:
                    self.specs.pop(ref.domain, None)
            case "member":
                key = (ref.domain, ref.clique, ref.node)
                if isinstance(payload, MemberRecord):
                    self.members[key] = payload
                else:
                    self.members.pop(key, None)
            case "health":
                if isinstance(payload, HealthReport):
                    self.reports[(ref.domain, ref.node)] = SeenReport(payload, expires_at)
                else:
                    self.reports.pop((ref.domain, ref.node), None)
            case "assignment":
                if isinstance(payload, Assignment):
                    self.assignments[ref.node] = payload.domain
                else:
                    self.assignments.pop(ref.node, None)
            case "presence":
                if isinstance(payload, Presence):
                    self.presences[ref.node] = payload
                else:
                    self.presences.pop(ref.node, None)
            case "ping":
                pass

    def records_of(self, domain: str) -> list[MemberRecord]:
        return [r for (d, _, _), r in sorted(self.members.items()) if d == domain]

    def reports_of(self, domain: str) -> list[SeenReport]:
        return [s for (d, _), s in sorted(self.reports.items()) if d == domain]

    def assigned_to(self, domain: str) -> list[str]:
        return sorted(n for n, d in self.assignments.items() if d == domain)

    def elsewhere(self, node: str, domain: str) -> list[str]:
        """Why `node` belongs to a live domain other than `domain`, one phrase each: an
        assignment to a domain whose spec exists and is not deleting, or a member record
        in another domain."""
        out: list[str] = []
        other = self.assignments.get(node)
        spec = self.specs.get(other) if other is not None and other != domain else None
        if spec is not None and spec.state != "deleting":
            out.append(f"assigned to {other} (spec generation {spec.generation}, active)")
        out.extend(
            f"{record.state.value} record in {d}"
            for (d, _, n), record in sorted(self.members.items())
            if n == node and d != domain
        )
        return out

    def last_seen(self, node: str) -> tuple[float | None, bool]:
        """When an agent last reported `node` (its presence or a health report, by their
        `at`; None: never), and whether it holds a member record anywhere (a live agent
        keeps one; its will clears it when it dies)."""
        times = [s.report.at for (_, n), s in self.reports.items() if n == node]
        presence = self.presences.get(node)
        if presence is not None:
            times.append(presence.at)
        recorded = any(n == node for _, _, n in self.members)
        return (max(times) if times else None), recorded

    def domains(self) -> list[str]:
        """Every domain with a spec, a member record, a health report or an assignment."""
        names = set(self.specs)
        names.update(d for d, _, _ in self.members)
        names.update(d for d, _ in self.reports)
        names.update(d for d in self.assignments.values() if d is not None)
        return sorted(names)


def summarize(store: Store, *, now: float, report_interval_s: float) -> list[DomainSummary]:
    """Every domain the bus knows, judged."""
    out = []
    for name in store.domains():
        spec = store.specs.get(name)
        records = store.records_of(name)
        status = judge(
            name,
            spec=spec,
            records=records,
            reports=store.reports_of(name),
            now=now,
            report_interval_s=report_interval_s,
        )
        out.append(
            DomainSummary(
                domain=name,
                spec=spec.state if spec else "-",
                generation=spec.generation if spec else None,
                max_nodes=spec.max_nodes if spec else (records[0].max_nodes if records else None),
                listed=len(spec.nodes) if spec and spec.nodes is not None else None,
                assigned=len(store.assigned_to(name)),
                members=len({r.node for r in records}),
                ready=status.ready,
                state=status.state,
            )
        )
    return out


# The link to the broker.


def default_client_id() -> str:
    """`imexd-control-<pid>-<random>`: the random part keeps two control planes with the
    same pid (one per container, say) from taking each other's session over."""
    return f"imexd-control-{os.getpid()}-{secrets.token_hex(3)}"


class Link:
    """One short-lived MQTT connection of the control plane (an async context manager).

    Entering connects to the first broker of `[bus] url` that answers within
    `connect_timeout_s` (the versions `[bus] protocol` allows, `bus.protocol_versions`:
    with "auto" MQTT 5, else 3.1.1 only when the broker refuses 5), or raises BusError
    naming each broker and why. `read` subscribes and returns once the retained snapshot
    is in `store`; `put` publishes a retained message; `verify` proves the broker kept
    what was put (a refused publish is otherwise invisible). A lost link raises BusError
    from the next call.
    """

    def __init__(
        self,
        settings: BusSettings,
        *,
        client_id: str | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        timeout_s: float = OPERATION_TIMEOUT_S,
    ) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.client_id = client_id or default_client_id()
        self.brokers: tuple[BrokerURL, ...] = tuple(parse_broker_url(u) for u in settings.url)
        if not self.brokers:
            raise ValueError("settings.url names no broker")
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self.store = Store()
        self.changed = asyncio.Event()
        """Set on every message and when the link is lost; the waiter clears it."""
        self.broker: str | None = None
        self.lost: str | None = None
        self._client: aiomqtt.Client | None = None
        self._reader: asyncio.Task[None] | None = None
        self._sync_topic = f"{self.topics.prefix}/domains/{SYNC_LEVEL}/sync/{self.client_id}"
        self._filters: list[str] = []
        self._seq = itertools.count(1)
        self._echoes: dict[int, asyncio.Future[None]] = {}
        self._last: dict[str, bytes] = {}

    async def __aenter__(self) -> Self:
        errors: list[str] = []
        for broker in self.brokers:
            try:
                self._client = await self._connect(broker)
            except BusError as exc:
                errors.append(str(exc))
                continue
            self.broker = str(broker)
            break
        else:
            raise BusError("; ".join(errors))
        self._reader = asyncio.create_task(self._read(self._client), name="control-read")
        try:
            await self._subscribe([self._sync_topic])
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        reader, client = self._reader, self._client
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if client is not None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await client.__aexit__(None, None, None)
            except (aiomqtt.MqttError, TimeoutError):
                abort_client(client)
        self._client = None

    async def _connect(self, broker: BrokerURL) -> aiomqtt.Client:
        password = self._password()
        versions = protocol_versions(self.settings)
        for v5 in versions:
            client = self._new_client(broker, v5=v5, password=password)
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    await client.__aenter__()
            except TimeoutError:
                discard_client(client)
                raise BusError(
                    f"cannot connect to {broker}: no answer within {self.connect_timeout_s:g} s"
                ) from None
            except aiomqtt.MqttError as exc:
                abort_client(client)
                if v5 and refuses_protocol(exc) and len(versions) > 1:
                    continue
                raise BusError(f"cannot connect to {broker}: {describe_error(exc)}") from None
            except BaseException:
                discard_client(client)
                raise
            return client
        raise BusError(
            f"cannot connect to {broker}: it refuses MQTT "
            + " and ".join("5" if v5 else "3.1.1" for v5 in versions)
        )

    def _password(self) -> str | None:
        return read_password(self.settings)

    def _new_client(self, broker: BrokerURL, *, v5: bool, password: str | None) -> aiomqtt.Client:
        return mqtt_client(
            self.settings,
            broker,
            client_id=self.client_id,
            v5=v5,
            password=password,
            timeout_s=self.timeout_s,
        )

    # Incoming messages.

    async def _read(self, client: aiomqtt.Client) -> None:
        try:
            async for message in client.messages:
                raw = message.payload
                payload = bytes(raw) if isinstance(raw, bytes | bytearray) else b""
                expiry = getattr(message.properties, "MessageExpiryInterval", None)
                self._on_message(
                    message.topic.value,
                    payload,
                    retained=bool(message.retain),
                    expiry_s=expiry if isinstance(expiry, int) else None,
                )
            self.lost = "the broker closed the connection"
        except aiomqtt.MqttError as exc:
            self.lost = describe_error(exc)
        for echo in self._echoes.values():
            if not echo.done():
                echo.set_exception(BusError(f"lost the broker {self.broker}: {self.lost}"))
        self.changed.set()

    def _on_message(
        self, topic: str, payload: bytes, *, retained: bool, expiry_s: int | None
    ) -> None:
        if topic == self._sync_topic:
            with contextlib.suppress(ValueError):
                echo = self._echoes.get(int(payload))
                if echo is not None and not echo.done():
                    echo.set_result(None)
            return
        self._last[topic] = payload
        result = decode_message(self.topics, topic, payload, retained=retained)
        if isinstance(result, Dropped):
            self.store.dropped[result.reason.value] += 1
            return
        expires_at = time.time() + expiry_s if expiry_s is not None else None
        self.store.apply(result, expires_at=expires_at)
        self.changed.set()

    # Operations.

    def _live(self) -> aiomqtt.Client:
        if self._client is None or self.lost is not None:
            raise BusError(f"lost the broker {self.broker}: {self.lost or 'not connected'}")
        return self._client

    def raise_if_lost(self) -> None:
        """BusError when the link is gone (the reader saw it end)."""
        self._live()

    async def _subscribe(self, filters: Sequence[str]) -> None:
        client = self._live()
        try:
            codes: list[int | ReasonCode] = list(
                await client.subscribe([(f, 1) for f in filters], timeout=self.timeout_s)
            )
        except aiomqtt.MqttError as exc:
            raise BusError(f"cannot subscribe at {self.broker}: {describe_error(exc)}") from None
        for topic_filter, code in zip(filters, codes, strict=False):
            value = code.value if isinstance(code, ReasonCode) else code
            if value >= 0x80:
                raise BusError(
                    f"the broker {self.broker} refused the subscription to {topic_filter} "
                    f"(code {code}): check its ACL for this user"
                )
        self._filters.extend(filters)

    async def read(self, *filters: str) -> Store:
        """Subscribe to `filters`; returns once their retained snapshot is in `store`."""
        new = [f for f in filters if f not in self._filters]
        if new:
            await self._subscribe(new)
        await self.sync()
        return self.store

    async def sync(self) -> None:
        """One round trip: every message the broker queued for us before it is delivered."""
        client = self._live()
        seq = next(self._seq)
        echo: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._echoes[seq] = echo
        try:
            async with asyncio.timeout(self.timeout_s):
                await client.publish(self._sync_topic, str(seq).encode(), qos=1)
                await echo
        except TimeoutError:
            raise BusError(
                f"no echo of our sync message on {self._sync_topic} within {self.timeout_s:g} s: "
                "the broker must let the control plane read and write it (ACL)"
            ) from None
        except aiomqtt.MqttError as exc:
            raise BusError(f"cannot publish to {self.broker}: {describe_error(exc)}") from None
        finally:
            self._echoes.pop(seq, None)

    async def put(self, topic: str, payload: bytes) -> None:
        """Publish a retained message (QoS 1); an empty payload deletes the retained one.

        The topic is subscribed first when no filter covers it, so `verify` can see it.
        """
        if not any(topic_matches(f, topic) for f in self._filters):
            await self._subscribe([topic])
        client = self._live()
        try:
            await client.publish(topic, payload, qos=1, retain=True, timeout=self.timeout_s)
        except aiomqtt.MqttError as exc:
            raise BusError(f"cannot publish to {topic}: {describe_error(exc)}") from None

    async def verify(self, written: Mapping[str, bytes]) -> list[str]:
        """The topics of `written` whose last message is not what we put there.

        A publish that an ACL refused still gets its PUBACK (MQTT 3.1.1, and aiomqtt 2.x
        drops MQTT 5 reason codes), so only reading it back tells.
        """
        await self.sync()
        return sorted(t for t, p in written.items() if self._last.get(t) != p)

    async def wait_until(self, done: Callable[[], bool], within_s: float) -> bool:
        """Wait at most `within_s` seconds until `done()` holds over the store; whether it did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            self.changed.clear()
            if done():
                return True
            self.raise_if_lost()
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 1.0)):
                    await self.changed.wait()


# Commands: each opens one link, reads what it needs, writes, verifies, and says what it did.


def _refused(refused: Sequence[str], err: TextIO) -> int:
    print(
        f"imexd: the broker did not keep our write to {', '.join(refused)} "
        "(refused by its ACL for the control plane's user, or written again since)",
        file=err,
    )
    return EXIT_FAILED


def _taken(store: Store, nodes: Iterable[str], domain: str, command: str, err: TextIO) -> int:
    """EXIT_USAGE after naming each node of `nodes` that another live domain holds, else
    EXIT_OK. Moving such a node stops the IMEX daemon a running job there may use."""
    taken = {n: why for n in nodes if (why := store.elsewhere(n, domain))}
    for node, why in taken.items():
        print(
            f"imexd {command}: node {node} is in another domain: {'; '.join(why)}. Moving it "
            f"to {domain} stops its IMEX daemon there (a running job loses IMEX); give --steal "
            "to move it anyway",
            file=err,
        )
    return EXIT_USAGE if taken else EXIT_OK


async def create(
    settings: Settings,
    name: str,
    *,
    nodes: list[str] | None,
    max_nodes: int | None,
    out: TextIO,
    err: TextIO,
    steal: bool = False,
) -> int:
    """Write the domain's spec, then the listed nodes' assignments (so that an assigned
    node already finds the spec, and its list position, when it joins).

    Refuses (EXIT_USAGE, writing nothing) when a listed node is in another live domain
    (`Store.elsewhere`), unless `steal`."""
    async with Link(settings.bus) as link:
        t = link.topics
        filters = [t.spec(name), *(t.assignment(n) for n in nodes or ())]
        if nodes and not steal:
            filters += [t.specs_filter(), t.all_members_filter("+")]
        store = await link.read(*filters)
        if not steal and _taken(store, nodes or (), name, "domain create", err):
            return EXIT_USAGE
        previous = store.specs.get(name)
        before = {n: store.assignments.get(n) for n in nodes or ()}
        spec = next_spec(
            previous,
            name,
            nodes=nodes,
            max_nodes=max_nodes,
            default_max_nodes=settings.domain.max_nodes,
        )
        if previous is not None and previous.max_nodes != spec.max_nodes:
            print(
                f"warning: max_nodes of {name} changes from {previous.max_nodes} to "
                f"{spec.max_nodes}: members configured otherwise report NodeMapMismatch",
                file=err,
            )
        written = {t.spec(name): encode(spec)}
        for node in nodes or ():
            written[t.assignment(node)] = encode(Assignment(domain=name))
        for topic, payload in written.items():
            await link.put(topic, payload)
        refused = await link.verify(written)
    if refused:
        return _refused(refused, err)
    verb = "created"
    if previous is not None:
        verb = "re-activated" if previous.state == "deleting" else "updated"
    listed = ",".join(spec.nodes) if spec.nodes is not None else "any node"
    print(
        f"domain {name}: {verb} (generation {spec.generation}, max_nodes {spec.max_nodes}, "
        f"nodes {listed})",
        file=out,
    )
    for node, was in before.items():
        note = f" (moved from {was})" if was not in (None, name) else ""
        print(f"node {node}: assigned to {name}{note}", file=out)
    return EXIT_OK


async def delete(settings: Settings, name: str, *, wait_s: float, out: TextIO, err: TextIO) -> int:
    """Set the spec to `deleting`, wait for the members to leave, then clear what is left.

    Agents that see `deleting` clear their member record and health report, stop their
    daemon and remove their files. Once no member record of the domain is left, the
    assignments that point at it are cleared first (an assigned agent then goes idle and
    does not rejoin), then the spec, then health reports left by vanished nodes. Two cases
    keep the spec in state `deleting` (a tombstone), so that nodes still pointing at the
    domain stay out of it:

    - members still hold records at the timeout (exit 1): their assignments and the
      health reports of nodes without records are cleared all the same, but their records
      are kept (the node may still run a daemon); running delete again finishes the job;
    - members without an assignment to the domain were seen (static nodes: `[domain] name`
      in their settings), which would otherwise form the domain again (exit 0).
    """
    async with Link(settings.bus) as link:
        t = link.topics
        store = await link.read(
            t.spec(name), t.all_members_filter(name), t.health_filter(name), t.assignments_filter()
        )
        spec = store.specs.get(name)
        records = store.records_of(name)
        if (
            spec is None
            and not records
            and not store.assigned_to(name)
            and not store.reports_of(name)
        ):
            print(
                f"domain {name}: nothing to delete (no spec, records, reports or assignments)",
                file=out,
            )
            return EXIT_OK
        static = sorted({r.node for r in records} - set(store.assigned_to(name)))
        if spec is None or spec.state != "deleting":
            spec = DomainSpec(
                domain=name,
                nodes=spec.nodes if spec is not None else None,
                max_nodes=spec.max_nodes
                if spec is not None
                else records[0].max_nodes
                if records
                else settings.domain.max_nodes,
                state="deleting",
                generation=spec.generation + 1 if spec is not None else 1,
            )
            await link.put(t.spec(name), encode(spec))
            refused = await link.verify({t.spec(name): encode(spec)})
            if refused:
                return _refused(refused, err)
        members = sorted({r.node for r in records})
        print(
            f"domain {name}: deleting (generation {spec.generation}); waiting up to {wait_s:g} s "
            f"for {len(members)} member(s) to leave"
            + (f": {', '.join(members)}" if members else ""),
            file=out,
        )
        started = time.monotonic()
        await link.wait_until(lambda: not store.records_of(name), wait_s)
        left = sorted({r.node for r in store.records_of(name)})
        # Agents clear their health report right after their record: give those a moment.
        grace = min(HEALTH_GRACE_S, max(0.0, wait_s - (time.monotonic() - started)))
        await link.wait_until(
            lambda: not any(s.report.node in members for s in store.reports_of(name)), grace
        )
        written: dict[str, bytes] = {}
        for node in store.assigned_to(name):
            written[t.assignment(node)] = b""
        keep_spec = bool(left or static)
        if not keep_spec:
            written[t.spec(name)] = b""
        reports = [s.report for s in store.reports_of(name) if s.report.node not in left]
        for report in reports:
            written[t.health(name, report.node)] = b""
        for topic, payload in written.items():
            await link.put(topic, payload)
        refused = await link.verify(written)
        stuck = [_describe_member(store, name, node) for node in left]
    if refused:
        return _refused(refused, err)
    assignments = sum(1 for topic in written if topic.endswith("/assignment"))
    cleared = f"{assignments} assignment(s), {len(reports)} leftover health report(s)"
    if left:
        print(
            f"imexd: domain {name}: {len(left)} member(s) still hold records after {wait_s:g} s: "
            f"{'; '.join(stuck)}. Cleared {cleared}; the spec stays in state deleting so that "
            f"they leave when they come back. Run `imexd domain delete {name}` again to finish.",
            file=err,
        )
        return EXIT_FAILED
    if static:
        print(
            f"domain {name}: all members left; cleared {cleared}. The spec stays in state "
            f"deleting: {', '.join(static)} name this domain in their settings ([domain] name) "
            f"and would form it again without it. Change their settings, then run "
            f"`imexd domain delete {name}` again to clear the spec.",
            file=out,
        )
        return EXIT_OK
    print(f"domain {name}: deleted (cleared the spec, {cleared})", file=out)
    return EXIT_OK


def _describe_member(store: Store, domain: str, node: str) -> str:
    record = next((r for r in store.records_of(domain) if r.node == node), None)
    seen = store.reports.get((domain, node))
    parts = [node]
    if record is not None:
        parts.append(f"record {record.state.value}")
    if seen is not None:
        parts.append(f"last report {time.time() - seen.report.at:.0f} s ago")
        reason = hl.reason_line(seen.report.conditions)
        if reason:
            parts.append(reason)
    return " (".join([parts[0], ", ".join(parts[1:]) + ")"]) if len(parts) > 1 else node


async def list_domains(settings: Settings, *, out: TextIO) -> int:
    """Print every domain with a spec, records, reports or assignments."""
    async with Link(settings.bus) as link:
        t = link.topics
        store = await link.read(
            t.specs_filter(),
            t.all_members_filter("+"),
            t.health_filter("+"),
            t.assignments_filter(),
        )
    summaries = summarize(
        store, now=time.time(), report_interval_s=settings.health.report_interval_s
    )
    print(render_list(summaries), end="", file=out)
    return EXIT_OK


async def assign(
    settings: Settings,
    node: str,
    domain: str | None,
    *,
    out: TextIO,
    err: TextIO,
    steal: bool = False,
    force: bool = False,
    seen_within_s: float = SEEN_WITHIN_S,
) -> int:
    """Write (or with None: clear) a node's retained assignment.

    Assigning refuses (EXIT_USAGE, writing nothing) a node in another live domain unless
    `steal` (see `create`), and a node that no agent reported within `seen_within_s`
    seconds (presence record or health report; a member record counts as seen) unless
    `force`: a typo would otherwise create a phantom domain that never forms."""
    async with Link(settings.bus) as link:
        t = link.topics
        topic = t.assignment(node)
        filters = [topic, *([t.spec(domain)] if domain else [])]
        if domain is not None:
            filters += [t.specs_filter(), t.all_members_filter("+")]
            filters += [t.health_filter("+"), t.presence(node)]
        store = await link.read(*filters)
        if domain is not None and not steal and _taken(store, [node], domain, "node assign", err):
            return EXIT_USAGE
        if domain is not None and not force:
            at, recorded = store.last_seen(node)
            if not recorded and (at is None or time.time() - at > seen_within_s):
                when = "never" if at is None else f"last {time.time() - at:.0f} s ago"
                print(
                    f"imexd node assign: no agent reported node {node} within "
                    f"{seen_within_s:g} s ({when}): a typo, or a node without a running agent; "
                    f"assigning it to {domain} would wait for it forever. Give --force to "
                    "assign it anyway",
                    file=err,
                )
                return EXIT_USAGE
        before = store.assignments.get(node)
        spec = store.specs.get(domain) if domain else None
        payload = encode(Assignment(domain=domain)) if domain else b""
        await link.put(topic, payload)
        refused = await link.verify({topic: payload})
    if refused:
        return _refused(refused, err)
    if domain is None:
        was = f"was {before}" if before else "it had no assignment"
        print(f"node {node}: unassigned ({was})", file=out)
        return EXIT_OK
    note = f" (moved from {before})" if before not in (None, domain) else ""
    print(f"node {node}: assigned to {domain}{note}", file=out)
    if spec is not None and spec.state == "deleting":
        print(f"warning: {domain} is being deleted: {node} leaves it at once", file=err)
    elif spec is not None and spec.nodes is not None and node not in spec.nodes:
        print(
            f"warning: the spec of {domain} lists only {', '.join(spec.nodes)}: {node} stays "
            f"out (NotInSpec) until `imexd domain create {domain} --nodes ...` lists it",
            file=err,
        )
    return EXIT_OK


def _fingerprint(status: DomainStatus) -> bytes:
    """The judgement without what changes with every second (ages, the time)."""
    still = msgspec.structs.replace(
        status,
        at=0.0,
        nodes=[msgspec.structs.replace(r, age_s=None) for r in status.nodes],
    )
    return msgspec.json.encode(still)


async def status(
    settings: Settings,
    name: str,
    *,
    as_json: bool,
    wait: float,
    out: TextIO,
    err: TextIO,
    nodes: Sequence[str] | None = None,
) -> int:
    """Print the domain's state once: after the retained snapshot, wait up to `wait`
    seconds more for it to become UP (changes in flight), then print and exit 0 if UP.

    `nodes` (`--nodes`) are the members to judge, instead of the spec's list."""
    interval = settings.health.report_interval_s
    async with Link(settings.bus) as link:
        t = link.topics
        store = await link.read(t.spec(name), t.all_members_filter(name), t.health_filter(name))

        def judged() -> DomainStatus:
            return _judge_store(store, name, interval, nodes)

        await link.wait_until(lambda: judged().state == "UP", wait)
        result = judged()
    if as_json:
        print(status_json(result), file=out)
    elif result.known:
        print(render_status(result), end="", file=out)
    if not result.known:
        print(
            f"imexd: domain {name}: nothing on the bus (no spec, member record or health report)",
            file=err,
        )
        return EXIT_FAILED
    return EXIT_OK if result.state == "UP" else EXIT_FAILED


def _judge_store(
    store: Store, name: str, report_interval_s: float, nodes: Sequence[str] | None = None
) -> DomainStatus:
    return judge(
        name,
        spec=store.specs.get(name),
        records=store.records_of(name),
        reports=store.reports_of(name),
        now=time.time(),
        report_interval_s=report_interval_s,
        expect=nodes,
    )


async def _event_or(event: asyncio.Event, stop: asyncio.Event, at_most_s: float) -> None:
    """Wait until `event` or `stop` is set, at most `at_most_s` seconds."""
    waiters = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())}
    try:
        await asyncio.wait(waiters, timeout=at_most_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def watch(
    settings: Settings,
    name: str,
    *,
    as_json: bool,
    stop: asyncio.Event,
    out: TextIO,
    err: TextIO,
    retry_s: float = 2.0,
    nodes: Sequence[str] | None = None,
) -> int:
    """Redraw the status on every change (and as reports age) until `stop`.

    On a terminal the screen is redrawn; otherwise each new table follows the previous
    one (with --json: one JSON document per line). A lost link is reconnected; a broker
    unreachable at the start is an error. The exit status is that of the last state.
    """
    interval = settings.health.report_interval_s
    tty = out.isatty()
    last: bytes | None = None
    state: DomainState | None = None
    connected_once = False
    while not stop.is_set():
        try:
            async with Link(settings.bus) as link:
                t = link.topics
                store = await link.read(
                    t.spec(name), t.all_members_filter(name), t.health_filter(name)
                )
                connected_once = True
                while not stop.is_set():
                    link.changed.clear()
                    result = _judge_store(store, name, interval, nodes)
                    key = _fingerprint(result)
                    if key != last:
                        last, state = key, result.state
                        _draw(result, as_json=as_json, tty=tty, out=out)
                    await _event_or(link.changed, stop, 1.0)
                    link.raise_if_lost()
        except BusError as exc:
            if not connected_once:
                raise
            print(f"imexd: {exc}; reconnecting", file=err, flush=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(retry_s):
                    await stop.wait()
    return EXIT_OK if state == "UP" else EXIT_FAILED


def _draw(result: DomainStatus, *, as_json: bool, tty: bool, out: TextIO) -> None:
    if as_json:
        out.write(status_json(result) + "\n")
    elif tty:
        out.write("\x1b[H\x1b[2J" + render_status(result) + "(watching; Ctrl-C to stop)\n")
    else:
        out.write(render_status(result) + "\n")
    out.flush()


# The CLI layer: argument checks (exit 2), settings, the event loop, signals, errors.


def load_control_settings(config: str | None, environ: Mapping[str, str] | None = None) -> Settings:
    """The same settings file and IMEXD_* environment as the agent's; only [bus], [domain]
    max_nodes and [health] report_interval_s matter here."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("IMEXD_NODE_NAME", CONTROL_NAME)
    return load_settings(config, environ=env)


def _usage(command: str, problems: Sequence[str]) -> int:
    for problem in problems:
        print(f"imexd {command}: {problem}", file=sys.stderr)
    return EXIT_USAGE


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        return asyncio.run(main)
    except BusError as exc:
        print(f"imexd: {exc}", file=sys.stderr)
        return EXIT_FAILED


def cli_domain_create(args: argparse.Namespace) -> int:
    """`imexd domain create NAME [--nodes a,b,c] [--max-nodes N]`."""
    nodes, problems = parse_nodes(args.nodes)
    problems = [
        p for p in (domain_problem(args.name), max_nodes_problem(args.max_nodes)) if p
    ] + problems
    if problems:
        return _usage("domain create", problems)
    settings = load_control_settings(args.config)
    return _run(
        create(
            settings,
            args.name,
            nodes=nodes,
            max_nodes=args.max_nodes,
            out=sys.stdout,
            err=sys.stderr,
            steal=args.steal,
        )
    )


def cli_domain_delete(args: argparse.Namespace) -> int:
    """`imexd domain delete NAME [--timeout S]`."""
    problems = [p for p in (domain_problem(args.name),) if p]
    if not args.timeout >= 0:
        problems.append(f"--timeout {args.timeout}: expected seconds >= 0")
    if problems:
        return _usage("domain delete", problems)
    settings = load_control_settings(args.config)
    return _run(delete(settings, args.name, wait_s=args.timeout, out=sys.stdout, err=sys.stderr))


def cli_domain_list(args: argparse.Namespace) -> int:
    """`imexd domain list`."""
    settings = load_control_settings(args.config)
    return _run(list_domains(settings, out=sys.stdout))


def cli_domain_status(args: argparse.Namespace) -> int:
    """`imexd domain status NAME [--nodes a,b] [--json] [--watch] [--wait S]`."""
    nodes, problems = parse_nodes(args.nodes)
    problems = [p for p in (domain_problem(args.name),) if p] + problems
    if not args.wait >= 0:
        problems.append(f"--wait {args.wait}: expected seconds >= 0")
    if problems:
        return _usage("domain status", problems)
    settings = load_control_settings(args.config)
    if not args.watch:
        return _run(
            status(
                settings,
                args.name,
                as_json=args.json,
                wait=args.wait,
                out=sys.stdout,
                err=sys.stderr,
                nodes=nodes,
            )
        )

    async def watching() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled: list[signal.Signals] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
        try:
            return await watch(
                settings,
                args.name,
                as_json=args.json,
                stop=stop,
                out=sys.stdout,
                err=sys.stderr,
                nodes=nodes,
            )
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    return _run(watching())


def cli_node_assign(args: argparse.Namespace) -> int:
    """`imexd node assign NODE DOMAIN [--steal] [--force] [--seen-within S]`."""
    problems = [p for p in (node_problem(args.node), domain_problem(args.domain)) if p]
    seen_within = SEEN_WITHIN_S if args.seen_within is None else args.seen_within
    if not seen_within >= 0:
        problems.append(f"--seen-within {seen_within}: expected seconds >= 0")
    if problems:
        return _usage("node assign", problems)
    settings = load_control_settings(args.config)
    return _run(
        assign(
            settings,
            args.node,
            args.domain,
            out=sys.stdout,
            err=sys.stderr,
            steal=args.steal,
            force=args.force,
            seen_within_s=float(seen_within),
        )
    )


def cli_node_unassign(args: argparse.Namespace) -> int:
    """`imexd node unassign NODE`."""
    problems = [p for p in (node_problem(args.node),) if p]
    if problems:
        return _usage("node unassign", problems)
    settings = load_control_settings(args.config)
    return _run(assign(settings, args.node, None, out=sys.stdout, err=sys.stderr))


# JSON Schemas shipped under docs/schemas/.


def schema_texts() -> dict[str, str]:
    """File name -> content of each shipped schema, generated from the payload types."""
    schemas = json_schemas()
    return {
        f"{name}.json": json.dumps(schemas[name], indent=2, sort_keys=True) + "\n"
        for name in SCHEMA_NAMES
    }


def write_schemas(folder: Path) -> list[Path]:
    """(Re)write the schemas into `folder`; the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, text in schema_texts().items():
        path = folder / filename
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def outdated_schemas(folder: Path) -> list[str]:
    """The schema files in `folder` that are missing or differ from the generated ones."""
    out = []
    for filename, text in schema_texts().items():
        path = folder / filename
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(filename)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m imexd.control --write-schemas DIR | --check-schemas DIR`."""
    parser = argparse.ArgumentParser(
        prog="python -m imexd.control",
        description="Generate or check the JSON Schemas of the bus payloads.",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-schemas", metavar="DIR", help="write the schemas into DIR")
    action.add_argument("--check-schemas", metavar="DIR", help="exit 1 if DIR's schemas differ")
    args = parser.parse_args(argv)
    if args.write_schemas:
        for path in write_schemas(Path(args.write_schemas)):
            print(path)
        return EXIT_OK
    outdated = outdated_schemas(Path(args.check_schemas))
    if outdated:
        print(
            f"outdated in {args.check_schemas}: {', '.join(outdated)} "
            f"(run python -m imexd.control --write-schemas {args.check_schemas})",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
