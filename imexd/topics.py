"""The bus's topics: built per prefix (`Topics`) and parsed back (`TopicRef`), with every
name in a level encoded so that no broker refuses or rewrites it (`encode_level`).

A leaf below imexd.messages, which judges what a topic may carry (`check_topic`).
"""

from __future__ import annotations

import functools
import re
import string
import urllib.parse
from typing import Final, Literal

import msgspec

from imexd.names import is_clique_id, is_dns1123_label, is_dns1123_subdomain

NO_CLIQUE_TOPIC: Final = "none"
"""The topic level standing for an empty clique (nodes without multi-node NVLink)."""

_LEVEL_SAFE: Final = frozenset(string.ascii_letters + string.digits + "-_")
_LEVEL_RE: Final = re.compile(r"^(?:[A-Za-z0-9_-]|%[0-9A-F]{2})*$")
WILDCARD: Final = "+"
"""A filter's single-level wildcard: passed as a name to a `*_filter` method it stays one."""


_LEVEL_ESCAPES: Final = {b: f"%{b:02X}" for b in range(256) if chr(b) not in _LEVEL_SAFE}
"""`str.translate` table from each byte (as the Latin-1 character of that value) to its
escape: every byte that is not a safe ASCII character."""


def encode_level(value: str) -> str:
    """One name as a portable topic level: every character but ASCII letters, digits, `-`
    and `_` becomes `%XX` (its UTF-8 bytes, upper-case hex).

    Levels must hold none of `.`, `/`, `+`, `#` or a space on every broker imexd runs
    on: NATS refuses a `.` in a level (its subjects use `.` as the separator), RabbitMQ
    turns it into `/`, and clique ids (`<uuid>.<id>`) and node names (`ip-10-0-1-2.ec2.
    internal`) hold dots. So `gpu-01` stays `gpu-01`, `c0ffee.1` becomes `c0ffee%2E1`.
    """
    return value.encode().decode("latin-1").translate(_LEVEL_ESCAPES)


def decode_level(level: str) -> str | None:
    """The name a topic level encodes, or None when the level is not `encode_level`'s
    one spelling of a name (lower-case hex, an escaped safe character, bad UTF-8): two
    spellings of one name would be two topics, and two records, for one node."""
    if not _LEVEL_RE.match(level):
        return None
    if "%" not in level:
        return level  # only safe characters: the level is the name
    try:
        value = urllib.parse.unquote(level, errors="strict")
    except UnicodeDecodeError:
        return None
    return value if encode_level(value) == level else None


def clique_level(clique: str) -> str:
    """The topic level for a clique id (`none` for the empty clique)."""
    return encode_level(clique) if clique else NO_CLIQUE_TOPIC


def _level(name: str) -> str:
    return name if name == WILDCARD else encode_level(name)


class Topics(msgspec.Struct, frozen=True):
    """Builds and parses every topic under one prefix, with names encoded per level
    (`encode_level`) and decoded back by `parse`."""

    prefix: str

    def member(self, domain: str, clique: str, node: str) -> str:
        return f"{self._domain(domain)}/members/{clique_level(clique)}/{_level(node)}"

    def members_filter(self, domain: str, clique: str) -> str:
        return f"{self._domain(domain)}/members/{_clique(clique)}/+"

    def all_members_filter(self, domain: str) -> str:
        return f"{self._domain(domain)}/members/+/+"

    def node_members_filter(self, domain: str, node: str) -> str:
        """`node`'s member records in `domain`, in whichever clique."""
        return f"{self._domain(domain)}/members/+/{_level(node)}"

    def health(self, domain: str, node: str) -> str:
        return f"{self._domain(domain)}/health/{_level(node)}"

    def health_filter(self, domain: str) -> str:
        return f"{self._domain(domain)}/health/+"

    def spec(self, domain: str) -> str:
        return f"{self._domain(domain)}/spec"

    def specs_filter(self) -> str:
        return f"{self.prefix}/domains/+/spec"

    def workload(self, domain: str, workload: str) -> str:
        return f"{self._domain(domain)}/workloads/{_level(workload)}"

    def workloads_filter(self, domain: str) -> str:
        """Every workload of `domain` (`+`: of every domain)."""
        return f"{self._domain(domain)}/workloads/+"

    def retry(self, domain: str, node: str) -> str:
        return f"{self._domain(domain)}/retry/{_level(node)}"

    def assignment(self, node: str) -> str:
        return f"{self._node(node)}/assignment"

    def assignments_filter(self) -> str:
        return f"{self.prefix}/nodes/+/assignment"

    def ping(self, node: str) -> str:
        return f"{self._node(node)}/ping"

    def presence(self, node: str) -> str:
        return f"{self._node(node)}/presence"

    def domain_filter(self, domain: str) -> str:
        """Everything under one domain: what an agent follows of a domain it left deleted."""
        return f"{self._domain(domain)}/#"

    def _domain(self, domain: str) -> str:
        return f"{self.prefix}/domains/{_level(domain)}"

    def _node(self, node: str) -> str:
        return f"{self.prefix}/nodes/{_level(node)}"

    def parse(self, topic: str) -> TopicRef | None:
        """What a topic under this prefix addresses (names decoded), or None for a foreign
        topic or one whose levels are not the one encoding of a name."""
        return route(self.prefix, topic)[0]


TOPIC_CACHE_SIZE: Final = 2048
"""Distinct topics whose parse `route` remembers (least recently used go first): an agent
hears a few dozen (its shard, spec, assignment, ping), a control plane one per node."""
TOPIC_CACHE_MAX_LEN: Final = 512
"""Longer topics are parsed afresh, so that hostile ones cannot make the cache hold more
than TOPIC_CACHE_SIZE short strings."""


def route(prefix: str, topic: str) -> tuple[TopicRef | None, str | None]:
    """`_parse` of `topic` and what is wrong with its names (`_topic_problem`), remembered
    per distinct topic: every delivery on a shard repeats one of a few dozen topics."""
    if len(topic) > TOPIC_CACHE_MAX_LEN:
        return _route_of(prefix, topic)
    return _remembered_route(prefix, topic)


def _route_of(prefix: str, topic: str) -> tuple[TopicRef | None, str | None]:
    ref = _parse(prefix, topic)
    return ref, None if ref is None else _topic_problem(ref)


_remembered_route: Final = functools.lru_cache(maxsize=TOPIC_CACHE_SIZE)(_route_of)


def _parse(prefix: str, topic: str) -> TopicRef | None:
    head = prefix + "/"
    if not topic.startswith(head):
        return None
    raw = topic[len(head) :].split("/")
    names = [decode_level(level) for level in raw]
    if any(name is None for name in names):
        return None
    parts = [name or "" for name in names]
    match parts:
        case ["domains", domain, "members", clique, node]:
            c = "" if raw[3] == NO_CLIQUE_TOPIC else clique
            return TopicRef("member", domain=domain, clique=c, node=node)
        case ["domains", domain, "health", node]:
            return TopicRef("health", domain=domain, node=node)
        case ["domains", domain, "spec"]:
            return TopicRef("spec", domain=domain)
        case ["domains", domain, "workloads", workload]:
            return TopicRef("workload", domain=domain, workload=workload)
        case ["domains", domain, "retry", node]:
            return TopicRef("retry", domain=domain, node=node)
        case ["nodes", node, "assignment"]:
            return TopicRef("assignment", node=node)
        case ["nodes", node, "ping"]:
            return TopicRef("ping", node=node)
        case ["nodes", node, "presence"]:
            return TopicRef("presence", node=node)
    return None


def _clique(clique: str) -> str:
    return clique if clique == WILDCARD else clique_level(clique)


class TopicRef(msgspec.Struct, frozen=True):
    """The parts of a parsed topic."""

    kind: Literal["member", "health", "spec", "workload", "assignment", "ping", "presence", "retry"]
    domain: str = ""
    clique: str = ""
    node: str = ""
    workload: str = ""


def _topic_problem(ref: TopicRef) -> str | None:
    """None when every name in a parsed topic is valid, else what is wrong."""
    if ref.node and not is_dns1123_subdomain(ref.node):
        return f"node {ref.node!r} in the topic is not a DNS-1123 subdomain"
    if ref.kind in ("member", "health", "spec", "workload") and not is_dns1123_label(ref.domain):
        return f"domain {ref.domain!r} in the topic is not a DNS-1123 label"
    if ref.kind == "workload" and not is_dns1123_label(ref.workload):
        return f"workload {ref.workload!r} in the topic is not a DNS-1123 label"
    if ref.kind == "member" and ref.clique and not is_clique_id(ref.clique):
        return f"clique {ref.clique!r} in the topic is not a clique id"
    return None
