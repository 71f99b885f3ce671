"""What may name a node, a domain and a clique: the checks every reader of names shares.

Settings validate `[node] name` and `[domain] name` with them, the bus checks the names
inside a topic with them before trusting a record, and the control plane refuses bad
command-line names with them (exit 2); every MQTT client id is derived here
(`client_id`). One leaf module, so that all of them agree and
none imports another to ask. The payload types in `imexd.messages` state the same rules
as JSON Schema patterns (they must stay expressible there).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Final

DNS1123_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS1123_SUBDOMAIN_PART: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CLIQUE_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CLIENT_ID_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_-]+")
CLIENT_ID_MAX: Final = 64
"""The longest derived client id (MQTT 3.1.1 promises only 23 characters, but every broker
of docs/brokers.md takes longer ones; a node name may be 253)."""
MAX_NODES_LIMIT: Final = 2048
"""The most slots per clique a domain may have (the payloads' `MaxNodes` bound)."""


def is_dns1123_label(name: str) -> bool:
    """A Kubernetes-style label: lowercase alphanumerics and '-', at most 63 characters."""
    return bool(DNS1123_LABEL.match(name))


def is_dns1123_subdomain(name: str) -> bool:
    """A DNS-1123 subdomain: dot-separated labels, at most 253 characters."""
    return (
        0 < len(name) <= 253
        and all(DNS1123_SUBDOMAIN_PART.match(p) for p in name.split("."))
        and all(len(p) <= 63 for p in name.split("."))
    )


def is_clique_id(value: str) -> bool:
    """A clique id as a bus topic level: `<uuid>.<id>`-like, no '/', '+' or '#'."""
    return bool(CLIQUE_RE.match(value))


def client_id(*parts: str) -> str:
    """The MQTT client id of `parts` joined by '-', in a form every broker accepts.

    Kept as it is when it holds only ASCII letters, digits, '_' and '-' and is at most
    `CLIENT_ID_MAX` characters (`client_id("imexd", "n1")` is "imexd-n1"). Otherwise each
    run of other characters becomes one '-', the readable part is cut to fit, and '-' and
    the first 8 hex digits of the SHA-256 of the joined original are appended:
    "n0027.c01.scale" gives "imexd-n0027-c01-scale-" and a hash. The same parts always
    give the same id, and two that differ give different ones (short of a hash collision):
    nats-server 2.14 refuses a client id holding a dot, and node names are often FQDNs.
    """
    original = "-".join(parts)
    readable = CLIENT_ID_UNSAFE.sub("-", original)
    if readable == original and 0 < len(original) <= CLIENT_ID_MAX:
        return original
    digest = hashlib.sha256(original.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    head = readable[: CLIENT_ID_MAX - len(digest) - 1].rstrip("-") or "id"
    return f"{head}-{digest}"


def domain_problem(name: str, *, kind: str = "domain") -> str | None:
    """None when `name` can name a domain (or a workload: `kind`), else a sentence saying
    why not; both are DNS-1123 labels."""
    if is_dns1123_label(name):
        return None
    return (
        f"{kind} name {name!r} is not a DNS-1123 label: lowercase letters, digits and '-', "
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
    if value is None or 1 <= value <= MAX_NODES_LIMIT:
        return None
    return f"--max-nodes {value}: expected 1 to {MAX_NODES_LIMIT} slots per clique"


JOB_NAME: Final = re.compile(r"^job-([1-9][0-9]*)$")
"""`job-<SLURM_JOB_ID>`: the per-job domain and the shared-layout workload the shipped Slurm
prologs (config/slurm/) create. Only the canonical form: `job-007` names no job."""
JOB_ID: Final = re.compile(r"^[0-9]+$")


def job_of(name: str) -> int | None:
    """The Slurm job id that domain or workload `name` is named after, or None."""
    found = JOB_NAME.match(name)
    return int(found.group(1)) if found else None


def parse_job_ids(text: str) -> tuple[frozenset[int], list[str]]:
    """Slurm job ids separated by whitespace or commas, as `squeue -h -o %A` prints them
    (plain numbers; an array task's `123_4` is `squeue -o %i`'s form, not an id), and
    the words that are not one. An empty text is no job (a cluster with none running)."""
    words = [w for w in re.split(r"[\s,]+", text) if w]
    bad = [w for w in words if not JOB_ID.match(w)]
    return frozenset(int(w) for w in words if JOB_ID.match(w)), bad
