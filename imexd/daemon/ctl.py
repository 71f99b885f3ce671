"""Probes of the IMEX daemon through `nvidia-imex-ctl`: the `Prober` and the output parsers.

The agent judges its daemon by what `<ctl> -c <config.cfg> -q` (the local state word)
and `-N -j` / `-N` (the whole domain) print. Both run through `process.run_bounded`, as
children in their own process group with the daemon's `[imex] env`; a ctl that hangs
(a peer's command port that never answers) is killed with its whole group and reaped,
so a periodic probe never stalls and never leaves zombies.

The parsers are pure functions of the text and raise only `ParseError`: the ctl's output
format is not versioned, the simulator may print statuses a real daemon never did, and a
probe loop must turn any of that into a reason, never into a crash. `Prober` bundles the
ctl path, config path, environment and timeout so the supervisor, the health checks and
the CLI share one way of asking.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import msgspec

from imexd.errors import ImexdError, ParseError, ProbeError
from imexd.imex import JSON_ALIASES, TEXT_CELLS, ConnectionState, ImexDomainState, ImexState
from imexd.process import OUTPUT_LIMIT, RunResult, run_bounded

if TYPE_CHECKING:
    from imexd.settings import Settings

_STATE_WORDS = frozenset(s.value for s in ImexState)


class LocalState(msgspec.Struct, frozen=True):
    """The parsed `-q` output.

    `exact` is true only when the output was precisely the word and one newline: the
    probe contract (IMEX.md) accepts `READY\\n` and nothing looser.
    """

    state: ImexState
    exact: bool


class NodeStatus(msgspec.Struct, frozen=True):
    """One node of the domain as the ctl reports it.

    `state` is an ImexState, or the raw word when the daemon printed one this version
    does not know. `connections` maps a peer's node index to how this node sees it.
    """

    index: int
    host: str
    host_name: str | None
    state: ImexState | str
    version: str | None
    local: bool
    connections: Mapping[int, ConnectionState]

    @property
    def ready(self) -> bool:
        return self.state == ImexState.READY


class DomainTable(msgspec.Struct, frozen=True):
    """The whole `-N` / `-N -j` report: IMEX's verdict, its timestamp, every node."""

    state: ImexDomainState | str
    timestamp: str
    nodes: Mapping[int, NodeStatus]

    @property
    def local(self) -> NodeStatus | None:
        """The node the ctl marked as local (text format only), if any."""
        return next((n for n in self.nodes.values() if n.local), None)


# Parsing helpers: every failure is a ParseError whose message quotes what was seen.


def _preview(text: str, limit: int = 80) -> str:
    shown = text if len(text) <= limit else text[:limit] + "..."
    return repr(shown)


def _as_text(data: object, what: str) -> str:
    """Bytes or str -> str, rejecting other types, bad UTF-8, empty and oversized input."""
    if isinstance(data, bytes | bytearray):
        if len(data) > OUTPUT_LIMIT:
            raise ParseError(f"{what}: {len(data)} bytes, more than the {OUTPUT_LIMIT} allowed")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ParseError(f"{what}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    elif isinstance(data, str):
        text = data
    else:
        raise ParseError(f"{what}: expected text, got {type(data).__name__}")
    if len(text) > OUTPUT_LIMIT:
        raise ParseError(f"{what}: {len(text)} characters, more than the {OUTPUT_LIMIT} allowed")
    if not text.strip():
        raise ParseError(f"{what}: empty output")
    return text


def _state_of(word: str) -> ImexState | str:
    return ImexState(word) if word in _STATE_WORDS else word


def _domain_state_of(word: str) -> ImexDomainState | str:
    try:
        return ImexDomainState(word)
    except ValueError:
        return word


def parse_state(text: str | bytes) -> LocalState:
    """Parse `ctl -q` output: exactly one of the IMEX state words (case-sensitive).

    Whitespace around the word is tolerated here but clears `exact`, so a caller can
    both name the state and refuse readiness on anything but `READY\\n`.
    """
    raw = _as_text(text, "ctl -q output")
    word = raw.strip()
    if word not in _STATE_WORDS:
        raise ParseError(
            f"ctl -q printed {_preview(raw)}; expected one word of " + ", ".join(_STATE_WORDS)
        )
    return LocalState(ImexState(word), exact=raw == word + "\n")


# `-N` text: a legend, a timestamp, `Nodes:`, one line per node, the matrix, the verdict.

_TIMESTAMP_RE = re.compile(r"\d{1,2}/\d{1,2}/\d{4} \d{1,2}:\d{2}:\d{2}(?:\.\d+)?", re.ASCII)
_NODE_RE = re.compile(
    r"Node\s*#\s*(?P<index>\d{1,6})\s+"
    r"(?:-\s*(?P<host>\S+)|\*\s*(?P<local>[^\s*]+)\s*\*)"
    r"\s*-\s*(?P<state>[A-Za-z_]+)"
    r"(?:\s+-\s*Version:\s*(?P<version>\S*))?",
    re.ASCII,
)
_HEADER_RE = re.compile(r"Nodes\s+From\\To(?P<cols>(?:\s+\d{1,6})+)", re.ASCII)
_ROW_RE = re.compile(r"(?P<index>\d{1,6})(?P<cells>(?:\s+\S+)+)", re.ASCII)
_UNKNOWN_CELL_RE = re.compile(r"!?[A-Z]!?", re.ASCII)
_DOMAIN_RE = re.compile(r"Domain State:\s*(?P<state>[A-Za-z_]+)", re.ASCII)


def _cell(token: str, line_no: int) -> ConnectionState:
    state = TEXT_CELLS.get(token)
    if state is not None:
        return state
    if _UNKNOWN_CELL_RE.fullmatch(token):
        return ConnectionState.UNKNOWN
    raise ParseError(f"ctl -N line {line_no}: {token!r} is not a connectivity cell")


def _version_of(text: str | None) -> str | None:
    return None if text in (None, "", "N/A") else text


def parse_domain_text(text: str | bytes) -> DomainTable:
    """Parse `ctl -N` text, both the 570.172 layout (`- Version:` column, `!V!`/`!M!`)
    and the older one without them; the local node is the one printed as `* name *`.

    The matrix must name exactly the listed nodes, in rows and columns, so a truncated
    or interleaved output is refused rather than half-read.
    """
    lines = _as_text(text, "ctl -N output").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Nodes:"), None)
    if start is None:
        raise ParseError("ctl -N output has no 'Nodes:' line")
    before = [line.strip() for line in lines[:start] if line.strip()]
    timestamp = before[-1] if before and _TIMESTAMP_RE.fullmatch(before[-1]) else ""

    nodes: dict[int, dict[str, Any]] = {}
    i = start + 1
    while i < len(lines) and lines[i].strip() and not _HEADER_RE.fullmatch(lines[i].strip()):
        line = lines[i].strip()
        m = _NODE_RE.fullmatch(line)
        if m is None:
            raise ParseError(f"ctl -N line {i + 1}: {_preview(line)} is not a node line")
        index = int(m["index"])
        if index in nodes:
            raise ParseError(f"ctl -N line {i + 1}: node #{index} listed twice")
        nodes[index] = {
            "host": m["host"] or m["local"],
            "local": m["local"] is not None,
            "state": _state_of(m["state"]),
            "version": _version_of(m["version"]),
        }
        i += 1
    if not nodes:
        raise ParseError("ctl -N output lists no nodes after 'Nodes:'")

    while i < len(lines) and not lines[i].strip():
        i += 1
    header = _HEADER_RE.fullmatch(lines[i].strip()) if i < len(lines) else None
    if header is None:
        raise ParseError("ctl -N output has no 'Nodes From\\To' matrix after the node lines")
    columns = [int(c) for c in header["cols"].split()]
    if sorted(columns) != sorted(nodes):
        raise ParseError(
            f"ctl -N matrix columns {columns} do not match the listed nodes {sorted(nodes)}"
        )
    i += 1

    rows: dict[int, dict[int, ConnectionState]] = {}
    state: ImexDomainState | str | None = None
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line:
            continue
        verdict = _DOMAIN_RE.fullmatch(line)
        if verdict is not None:
            state = _domain_state_of(verdict["state"])
            break
        m = _ROW_RE.fullmatch(line)
        if m is None:
            raise ParseError(f"ctl -N line {i}: {_preview(line)} is not a matrix row")
        index = int(m["index"])
        cells = m["cells"].split()
        if index not in nodes or index in rows:
            raise ParseError(f"ctl -N line {i}: unexpected matrix row for node #{index}")
        if len(cells) != len(columns):
            raise ParseError(
                f"ctl -N line {i}: row #{index} has {len(cells)} cells, expected {len(columns)}"
            )
        rows[index] = {col: _cell(tok, i) for col, tok in zip(columns, cells, strict=True)}
    if state is None:
        raise ParseError("ctl -N output has no 'Domain State:' line (truncated?)")
    if set(rows) != set(nodes):
        missing = sorted(set(nodes) - set(rows))
        raise ParseError(f"ctl -N matrix has no row for nodes {missing}")

    return DomainTable(
        state=state,
        timestamp=timestamp,
        nodes=MappingProxyType(
            {
                index: NodeStatus(
                    index=index,
                    host=info["host"],
                    host_name=None,
                    state=info["state"],
                    version=info["version"],
                    local=info["local"],
                    connections=MappingProxyType(rows[index]),
                )
                for index, info in sorted(nodes.items())
            }
        ),
    )


# `-N -j` JSON.

_INDEX_RE = re.compile(r"\d{1,6}", re.ASCII)


def _index(key: str, where: str) -> int:
    if not _INDEX_RE.fullmatch(key):
        raise ParseError(f"ctl -N -j: {where} key {_preview(key)} is not a node index")
    return int(key)


def _str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        kind = "missing" if key not in obj else f"a {type(value).__name__}"
        raise ParseError(f"ctl -N -j: {where}.{key} is {kind}, expected a string")
    return value


def _opt_str(obj: Mapping[str, Any], key: str, where: str) -> str | None:
    return None if obj.get(key) is None else _str(obj, key, where)


def _connection_of(word: str) -> ConnectionState:
    try:
        return ConnectionState(word)
    except ValueError:
        return JSON_ALIASES.get(word, ConnectionState.UNKNOWN)


def parse_domain_json(text: str | bytes) -> DomainTable:
    """Parse `ctl -N -j`. Unknown fields are ignored; unknown connection words read as
    UNKNOWN and unknown node or domain words are kept raw, so the simulator or a newer
    daemon can add statuses without breaking the probe; wrong types are a ParseError.

    `hostName` "N/A" (IMEX's placeholder) becomes None. The JSON marks no local node.
    """
    raw = _as_text(text, "ctl -N -j output")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise ParseError(f"ctl -N -j printed no valid JSON ({detail}): {_preview(raw)}") from None
    if not isinstance(doc, dict):
        raise ParseError(f"ctl -N -j: expected a JSON object, got {type(doc).__name__}")
    state_word = _str(doc, "status", "top")
    if not state_word:
        raise ParseError("ctl -N -j: top.status is empty")
    timestamp = _opt_str(doc, "timestamp", "top") or ""
    raw_nodes = doc.get("nodes")
    if not isinstance(raw_nodes, dict):
        raise ParseError("ctl -N -j: top.nodes is missing or not an object")
    if not raw_nodes:
        raise ParseError("ctl -N -j: top.nodes is empty")

    nodes: dict[int, NodeStatus] = {}
    for key, node in raw_nodes.items():
        index = _index(key, "nodes")
        where = f"nodes.{key}"
        if not isinstance(node, dict):
            raise ParseError(f"ctl -N -j: {where} is a {type(node).__name__}, expected an object")
        status = _str(node, "status", where)
        host = _str(node, "host", where)
        host_name = _opt_str(node, "hostName", where)
        version = _opt_str(node, "version", where)
        raw_conns = node.get("connections", {})
        if not isinstance(raw_conns, dict):
            raise ParseError(f"ctl -N -j: {where}.connections is not an object")
        connections: dict[int, ConnectionState] = {}
        for peer_key, conn in raw_conns.items():
            peer = _index(peer_key, f"{where}.connections")
            if not isinstance(conn, dict):
                raise ParseError(f"ctl -N -j: {where}.connections.{peer_key} is not an object")
            word = _str(conn, "status", f"{where}.connections.{peer_key}")
            connections[peer] = _connection_of(word)
        nodes[index] = NodeStatus(
            index=index,
            host=host,
            host_name=None if host_name in (None, "", "N/A") else host_name,
            state=_state_of(status),
            version=_version_of(version),
            local=False,
            connections=MappingProxyType(dict(sorted(connections.items()))),
        )
    return DomainTable(
        state=_domain_state_of(state_word),
        timestamp=timestamp,
        nodes=MappingProxyType(dict(sorted(nodes.items()))),
    )


class LocalProbe(msgspec.Struct, frozen=True):
    """One local probe: the state seen (None when none could be read), whether it counts
    as ready, and why not (empty when ready)."""

    state: ImexState | None
    ready: bool
    reason: str
    duration: float
    error: ImexdError | None = None


class DomainResult(msgspec.Struct, frozen=True):
    """One domain probe: the parsed report, or None and the reason."""

    status: DomainTable | None
    reason: str
    duration: float
    error: ImexdError | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class Prober:
    """How to ask the local IMEX daemon: `<ctl> -c <config_path> ...` with `env` merged
    over the agent's environment (the same as the daemon's), bounded by `timeout`.

    Explicit fields rather than Settings so the supervisor, the health checks and tests
    can build one from whatever they hold; `from_settings` is the usual way.
    """

    ctl: str
    config_path: str
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    timeout: float = 5.0

    def __post_init__(self) -> None:
        if not self.ctl:
            raise ValueError("Prober.ctl: expected the path or name of nvidia-imex-ctl")
        if not self.timeout > 0:
            raise ValueError(f"Prober.timeout = {self.timeout!r}: expected seconds > 0")
        object.__setattr__(self, "config_path", os.fspath(self.config_path))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    @classmethod
    def from_settings(cls, settings: Settings) -> Prober:
        """imex.ctl, <run_dir>/config.cfg, imex.env and daemon.probe_timeout_s."""
        return cls(
            ctl=settings.imex.ctl,
            config_path=str(settings.config_path),
            env=settings.imex.env,
            timeout=settings.daemon.probe_timeout_s,
        )

    def argv(self, args: Sequence[str]) -> list[str]:
        return [self.ctl, "-c", self.config_path, *args]

    async def run(self, args: Sequence[str], *, timeout: float | None = None) -> RunResult:  # noqa: ASYNC109 - kill deadline
        """Run the ctl once; ProbeError when it is missing, cannot start or times out."""
        limit = self.timeout if timeout is None else timeout
        argv = self.argv(args)
        try:
            return await run_bounded(argv, timeout=limit, env={**os.environ, **self.env})
        except TimeoutError:
            raise ProbeError(
                f"ctl timed out after {limit:g} s and was killed: {shlex.join(argv)}"
            ) from None
        except FileNotFoundError as exc:
            raise ProbeError(
                f"imex.ctl = {self.ctl!r}: no such program; set [imex] ctl "
                "(IMEXD_IMEX_CTL) to the path of nvidia-imex-ctl"
            ) from exc
        except PermissionError as exc:
            raise ProbeError(
                f"imex.ctl = {self.ctl!r}: not executable ({exc.strerror}); check [imex] ctl"
            ) from exc
        except OSError as exc:
            raise ProbeError(f"imex.ctl = {self.ctl!r}: cannot run it: {exc}") from exc

    async def local(self, *, timeout: float | None = None) -> LocalProbe:  # noqa: ASYNC109 - kill deadline
        """`ctl -q`: ready only on exit 0 with exactly `READY\\n`. Never raises a probe
        or parse failure; they come back as the reason."""
        started = time.monotonic()
        try:
            result = await self.run(["-q"], timeout=timeout)
        except ProbeError as exc:
            return LocalProbe(None, False, str(exc), time.monotonic() - started, exc)
        try:
            parsed = parse_state(result.stdout)
        except ParseError as exc:
            if result.rc != 0:
                reason = f"ctl -q exited with {result.rc}: {result.tail() or 'no output'}"
                return LocalProbe(None, False, reason, result.duration, ProbeError(reason))
            return LocalProbe(None, False, str(exc), result.duration, exc)
        if result.rc != 0:
            reason = f"ctl -q printed {parsed.state} but exited with {result.rc}"
            return LocalProbe(parsed.state, False, reason, result.duration, ProbeError(reason))
        if parsed.state is not ImexState.READY:
            return LocalProbe(parsed.state, False, f"IMEX is {parsed.state}", result.duration)
        if not parsed.exact:
            reason = f"ctl -q printed {result.stdout!r}, not exactly 'READY\\n'"
            return LocalProbe(parsed.state, False, reason, result.duration, ParseError(reason))
        return LocalProbe(parsed.state, True, "", result.duration)

    async def domain(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - kill deadline
        json_format: bool = True,
    ) -> DomainResult:
        """`ctl -N -j` (or `-N` text): the domain report, or the reason there is none.

        The output is parsed whatever the exit code: whether the ctl exits non-zero on a
        DEGRADED domain is undocumented, and a report that parses is the better fact.
        """
        started = time.monotonic()
        args = ["-N", "-j"] if json_format else ["-N"]
        parse = parse_domain_json if json_format else parse_domain_text
        try:
            result = await self.run(args, timeout=timeout)
        except ProbeError as exc:
            return DomainResult(None, str(exc), time.monotonic() - started, exc)
        if result.truncated:
            reason = f"ctl {' '.join(args)} printed more than {OUTPUT_LIMIT} bytes"
            return DomainResult(None, reason, result.duration, ParseError(reason))
        try:
            return DomainResult(parse(result.stdout), "", result.duration)
        except ParseError as exc:
            if result.rc != 0:
                reason = (
                    f"ctl {' '.join(args)} exited with {result.rc}: {result.tail() or 'no output'}"
                )
                return DomainResult(None, reason, result.duration, ProbeError(reason))
            return DomainResult(None, str(exc), result.duration, exc)
