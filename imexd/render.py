"""Rendering the IMEX files: config.cfg, nodes_config.cfg and the hosts block.

Every function here is a pure function of data (no clock, no disk, no environment), so
that all nodes of a domain that see the same members write byte-identical node lists,
and so that the agent can compare what it would write with what is on disk (adoption
of a running daemon, "restart only when config.cfg changed"). `read_members` is the only
piece with I/O: it reads the records of the operator's dry run `imexd render` (`dry_run`).

Formats (DESIGN.md "Files"):

- config.cfg: `KEY=value` lines in a fixed order, one stable header comment.
- nodes_config.cfg, names mode: exactly max_nodes lines `imex-<h>-<slot:04d>`.
- nodes_config.cfg, addresses mode: the members' addresses in slot order.
- hosts: one block `# BEGIN imexd <domain>` ... `# END imexd` with one line per slot.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import msgspec

from imexd.errors import ConfigError, ParseError
from imexd.imex import EMPTY_SLOT_ADDRESS, IMEX_DEFAULTS, check_extra
from imexd.membership.slots import resolve
from imexd.messages import MemberRecord, address_problem
from imexd.settings import Settings

CONFIG_HEADER: Final = "# Written by imexd from its settings; edits are overwritten."


class RenderError(ValueError):
    """The renderer refuses its input or its own output; nothing is written.

    Raised for an address that could not stand alone on a line (the wire refuses such
    records already; this is the second line of defence, so that no bug upstream can put
    a line into a hosts file), and when a rendered hosts block does not parse back to
    exactly the slots asked for. A ValueError, so callers that catch ValueError keep
    working.
    """


BEGIN_PREFIX: Final = "# BEGIN imexd "
END_MARKER: Final = "# END imexd"

_SLOT_NAME_RE: Final = re.compile(r"^imex-([0-9a-f]{8})-([0-9]{4})$")
_BEGIN_RE: Final = re.compile(r"^# BEGIN imexd (\S+)$")


def render_config(settings: Settings, *, address: str | None = None) -> str:
    """The config.cfg text for this node: every IMEX key, one `KEY=value` per line.

    Differences from IMEX's defaults, and why: DAEMONIZE=0 (the agent supervises the
    process), LOG_FILE_NAME and STATS_FILE_NAME empty (the daemon logs to stderr, which
    the agent turns into log events), BIND_INTERFACE_IP and IMEX_CMD_BIND_INTERFACE_IP
    the node address (several simulated nodes share a host; the ctl probes that
    address), the ports from the settings, IMEX_NODE_CONFIG_FILE the absolute path the
    agent writes. `[imex] extra` overrides keys in place and appends unknown keys in
    sorted order, so the text is byte-for-byte stable for the same settings.

    Raises ConfigError when `extra` sets a key in RESERVED_KEYS.
    """
    imex = settings.imex
    problems = check_extra(imex.extra)
    if problems:
        raise ConfigError(problems)
    node_address = settings.node.address if address is None else address
    if node_address:
        _check_address(node_address)
    values = dict(IMEX_DEFAULTS)
    values.update(
        {
            "LOG_FILE_NAME": "",
            "STATS_FILE_NAME": "",
            "DAEMONIZE": "0",
            "BIND_INTERFACE_IP": node_address,
            "SERVER_PORT": str(imex.server_port),
            "IMEX_NODE_CONFIG_FILE": str(settings.nodes_config_path),
            "IMEX_CMD_ENABLED": "1",
            "IMEX_CMD_BIND_INTERFACE_IP": node_address,
            "IMEX_CMD_PORT": str(imex.cmd_port),
        }
    )
    values.update(imex.extra)
    known = [key for key, _ in IMEX_DEFAULTS]
    order = known + sorted(key for key in values if key not in known)
    lines = [CONFIG_HEADER] + [f"{key}={values[key]}" for key in order]
    return "\n".join(lines) + "\n"


def clique_hash(domain: str, clique: str) -> str:
    """Eight lowercase hex digits that tell (domain, clique) pairs apart in slot names.

    The reference driver reuses identical slot names in every domain, so a stale hosts
    entry of one domain can silently connect another; a hash of both keeps them apart.
    """
    return hashlib.sha256(f"{domain}\0{clique}".encode()).hexdigest()[:8]


def slot_name(domain: str, clique: str, slot: int) -> str:
    """The host name of one slot, `imex-<h>-<slot:04d>`, a valid DNS-1123 label."""
    if not 0 <= slot <= 9999:
        raise ValueError(f"slot {slot} is outside 0..9999")
    return f"imex-{clique_hash(domain, clique)}-{slot:04d}"


def render_nodes_config_names(domain: str, clique: str, max_nodes: int) -> str:
    """Names mode: exactly max_nodes lines of slot names and nothing else.

    The list never changes while the domain lives, so membership changes never restart
    the daemon; only the hosts block moves.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes {max_nodes} is not >= 1")
    return "".join(f"{slot_name(domain, clique, slot)}\n" for slot in range(max_nodes))


def render_nodes_config_addresses(slots: Mapping[int, str]) -> str:
    """Addresses mode: the members' addresses in slot order, one per line.

    Empty slots are skipped, not padded: there is no address to write for them, and in
    this mode any change of the list restarts the daemon anyway. Every node renders
    the same list from the same members, so line numbers (IMEX node ids) still agree.
    """
    lines = []
    for slot in sorted(slots):
        address = slots[slot]
        _check_address(address)
        line = f"{address}\n"
        if line.split() != [address] or line.count("\n") != 1:
            raise RenderError(f"the node list line of slot {slot} does not hold one address")
        lines.append(line)
    return "".join(lines)


def render_nodes_config(
    *, domain: str, clique: str, max_nodes: int, mode: str, slots: Mapping[int, str]
) -> str:
    """nodes_config.cfg in the given mode ("names" or "addresses")."""
    if mode == "names":
        return render_nodes_config_names(domain, clique, max_nodes)
    if mode == "addresses":
        return render_nodes_config_addresses(slots)
    raise ValueError(f'mode {mode!r} is not "names" or "addresses"')


# hosts


class _Block(msgspec.Struct, frozen=True):
    """One imexd block found in a hosts text: lines [start, end) and its domain."""

    start: int
    end: int
    domain: str
    glued: bool
    """The block's last line has no newline: merge added the one before it."""


def _lines(text: str) -> list[str]:
    """Split on "\\n" only, keeping it: joining the result gives back `text` exactly."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _marker(line: str) -> str:
    return line.rstrip(" \t\r\n")


def _slot_line(line: str) -> tuple[str, int] | None:
    """(address, slot) of a line `<address> imex-<h>-<slot>`, else None."""
    fields = _marker(line).split()
    if len(fields) != 2:
        return None
    match = _SLOT_NAME_RE.match(fields[1])
    return None if match is None else (fields[0], int(match.group(2)))


def _find_blocks(lines: list[str]) -> list[_Block]:
    """Every imexd block, in order.

    A block runs from a `# BEGIN imexd <domain>` line to the next `# END imexd` line.
    A BEGIN line with no END before the next BEGIN or the end of the text (a
    truncated or hand-edited file) owns only the slot lines right after it, so a lost
    END marker can never make the merge eat the rest of the file.
    """
    blocks: list[_Block] = []
    i = 0
    while i < len(lines):
        match = _BEGIN_RE.match(_marker(lines[i]))
        if match is None:
            i += 1
            continue
        end = None
        for j in range(i + 1, len(lines)):
            marker = _marker(lines[j])
            if marker == END_MARKER:
                end = j + 1
                break
            if _BEGIN_RE.match(marker):
                break
        if end is None:
            end = i + 1
            while end < len(lines) and _slot_line(lines[end]) is not None:
                end += 1
        glued = not lines[end - 1].endswith("\n")
        blocks.append(_Block(i, end, match.group(1), glued))
        i = end
    return blocks


def _split_blocks(text: str) -> tuple[str, int | None, list[_Block], list[str]]:
    """The text without imexd blocks, where the first one stood, the blocks, the lines.

    When the last block ends the text without a newline, the newline that merge put
    before it (the original text did not end with one) is taken out again.
    """
    lines = _lines(text)
    blocks = _find_blocks(lines)
    if not blocks:
        return text, None, [], lines
    pieces: list[str] = []
    cursor = 0
    position: int | None = None
    for block in blocks:
        pieces.extend(lines[cursor : block.start])
        if position is None:
            position = sum(len(p) for p in pieces)
        cursor = block.end
    pieces.extend(lines[cursor:])
    outside = "".join(pieces)
    if blocks[-1].glued and blocks[-1].end == len(lines) and outside.endswith("\n"):
        outside = outside[:-1]
        position = min(position or 0, len(outside))
    return outside, position, blocks, lines


def _check_address(address: str) -> None:
    """RenderError unless `address` may be a node's address (messages.address_problem)."""
    problem = address_problem(address)
    if problem is not None:
        raise RenderError(f"refusing to render: {problem}")


def verify_hosts_block(
    block: str, domain: str, clique: str, slots: Mapping[int, str | None], max_nodes: int
) -> None:
    """RenderError unless `block` is exactly the hosts block asked for, line by line.

    Each line must parse back, by whitespace, to exactly one canonical address and the
    slot's name, in slot order between the two markers, and nothing else: the last check
    before a text reaches every peer's hosts file, whatever built it.
    """
    lines = block.split("\n")
    if lines[-1] != "" or len(lines) != max_nodes + 3:
        raise RenderError(
            f"hosts block has {len(lines) - 1} lines, expected {max_nodes + 2}: refusing it"
        )
    if (m := _BEGIN_RE.match(lines[0])) is None or m.group(1) != domain:
        raise RenderError(f"hosts block begins with {lines[0]!r}, not the {domain} marker")
    if lines[-2] != END_MARKER:
        raise RenderError(f"hosts block ends with {lines[-2]!r}, not {END_MARKER!r}")
    for slot, line in enumerate(lines[1:-2]):
        address = slots.get(slot) or EMPTY_SLOT_ADDRESS
        expected = [address, slot_name(domain, clique, slot)]
        fields = line.split()
        if fields != expected or line != " ".join(expected):
            raise RenderError(
                f"hosts block line {line!r} does not parse back to {' '.join(expected)!r}"
            )
        if str(ipaddress.ip_address(fields[0])) != fields[0]:
            raise RenderError(f"hosts block line {line!r} holds a non-canonical address")


def render_hosts_block(
    domain: str, clique: str, slots: Mapping[int, str | None], max_nodes: int
) -> str:
    """The block alone: markers and one `<address> <slot name>` line per slot.

    Every slot 0..max_nodes-1 gets a line; empty ones point at EMPTY_SLOT_ADDRESS.
    Raises ValueError for a slot outside the range or a bad domain, RenderError (a
    ValueError) for a bad address or a block that does not verify.
    """
    if not domain or any(c.isspace() for c in domain):
        raise ValueError(f"domain {domain!r} is not a non-empty name without spaces")
    if max_nodes < 1:
        raise ValueError(f"max_nodes {max_nodes} is not >= 1")
    for slot, address in slots.items():
        if not 0 <= slot < max_nodes:
            raise ValueError(f"slot {slot} is outside 0..{max_nodes - 1}")
        if address is not None:
            _check_address(address)
    lines = [f"{BEGIN_PREFIX}{domain}\n"]
    for slot in range(max_nodes):
        address = slots.get(slot) or EMPTY_SLOT_ADDRESS
        lines.append(f"{address} {slot_name(domain, clique, slot)}\n")
    lines.append(f"{END_MARKER}\n")
    block = "".join(lines)
    verify_hosts_block(block, domain, clique, slots, max_nodes)
    return block


def _insert(outside: str, position: int, block: str) -> str:
    if position == len(outside) and outside and not outside.endswith("\n"):
        # The text lacks a final newline: add one, and leave it off the block, so
        # that removing the block gives back exactly the original text.
        return outside + "\n" + block[:-1]
    return outside[:position] + block + outside[position:]


def merge_hosts(
    current: str,
    domain: str,
    clique: str,
    slots: Mapping[int, str | None],
    max_nodes: int,
) -> str:
    """The hosts text with this domain's block in it, everything else kept byte for byte.

    The block replaces the first imexd block found (of any domain: a node is in one
    domain at a time, so another domain's block is stale) and every other imexd block
    is removed; with no block yet, it is appended. Applying the result again changes
    nothing, and `remove_hosts_block` of the result gives back `current` when it held
    no imexd block.
    """
    block = render_hosts_block(domain, clique, slots, max_nodes)
    outside, position, _, _ = _split_blocks(current)
    return _insert(outside, len(outside) if position is None else position, block)


def remove_hosts_block(current: str) -> str:
    """The hosts text without any imexd block (when the node leaves its domain)."""
    return _split_blocks(current)[0]


def parse_hosts_block(text: str) -> tuple[str, dict[int, str | None]] | None:
    """The domain and slot -> address (None: empty slot) of the first imexd block.

    None when the text has no block. Lines of the block that are not slot lines are
    ignored. `parse_hosts_block(merge_hosts(t, d, c, s, n))` is `(d, {i: s.get(i)})`
    for every slot i below n.
    """
    _, _, blocks, lines = _split_blocks(text)
    if not blocks:
        return None
    first = blocks[0]
    slots: dict[int, str | None] = {}
    for line in lines[first.start + 1 : first.end]:
        found = _slot_line(line)
        if found is not None:
            address, slot = found
            slots[slot] = None if address == EMPTY_SLOT_ADDRESS else address
    return first.domain, slots


# The operator's dry run


class RenderedFiles(msgspec.Struct, frozen=True):
    """The three files the agent would write for one (domain, clique)."""

    config: str
    nodes_config: str
    hosts: str


def render_files(
    settings: Settings,
    *,
    domain: str,
    clique: str,
    slots: Mapping[int, str],
    hosts_current: str,
    address: str | None = None,
) -> RenderedFiles:
    """config.cfg, nodes_config.cfg and the whole hosts text, from the settings.

    In addresses mode no names are used, so the hosts text only loses any imexd block.
    """
    max_nodes = settings.domain.max_nodes
    mode = settings.domain.mode
    if mode == "names":
        hosts = merge_hosts(hosts_current, domain, clique, slots, max_nodes)
    else:
        hosts = remove_hosts_block(hosts_current)
    return RenderedFiles(
        config=render_config(settings, address=address),
        nodes_config=render_nodes_config(
            domain=domain, clique=clique, max_nodes=max_nodes, mode=mode, slots=slots
        ),
        hosts=hosts,
    )


def _check_records(settings: Settings, records: Sequence[MemberRecord]) -> tuple[str, str]:
    """The (domain, clique) the records describe; ParseError when they disagree."""
    problems: list[str] = []
    domain = settings.domain.name
    clique = settings.node.clique
    for index, record in enumerate(records):
        where = f"record {index} ({record.node})"
        if domain and record.domain != domain:
            problems.append(f"{where}: domain {record.domain!r}, expected {domain!r}")
        domain = domain or record.domain
        if clique not in ("auto", record.clique):
            problems.append(f"{where}: clique {record.clique!r}, expected {clique!r}")
        clique = record.clique if clique == "auto" else clique
        if record.max_nodes != settings.domain.max_nodes:
            problems.append(
                f"{where}: max_nodes {record.max_nodes}, expected {settings.domain.max_nodes} "
                "(domain.max_nodes)"
            )
        if record.mode != settings.domain.mode:
            problems.append(
                f"{where}: mode {record.mode!r}, expected {settings.domain.mode!r} (domain.mode)"
            )
    nodes = [r.node for r in records]
    for node in sorted({n for n in nodes if nodes.count(n) > 1}):
        problems.append(f"node {node} has more than one record")
    if not domain:
        problems.append("no domain: set domain.name or give at least one member record")
    if clique == "auto":
        problems.append("no clique: set node.clique or give at least one member record")
    if problems:
        raise ParseError("; ".join(problems))
    return domain, clique


def read_members(path: str) -> list[MemberRecord]:
    """The member records of a JSON file (`imexd render --members`); ParseError if not."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ParseError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return msgspec.json.decode(data, type=list[MemberRecord])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ParseError(f"{path}: not a JSON list of member records: {exc}") from exc


def dry_run(
    settings: Settings, records: Sequence[MemberRecord], *, hosts_current: str
) -> tuple[tuple[str, str, str], ...]:
    """What the agent would write for these records: (path, file name, text) per file.

    Slots come from `slots.resolve`, the rule the agent applies to the same
    records, so the dry run cannot disagree with the agent: two records on one slot
    render the one the agent would keep. ParseError when the records disagree with the
    settings or each other; RenderError (a ValueError) when one cannot be rendered.
    """
    domain, clique = _check_records(settings, records)
    slot_map = resolve(records, max_nodes=settings.domain.max_nodes)
    files = render_files(
        settings,
        domain=domain,
        clique=clique,
        slots={slot: record.address for slot, record in slot_map.members.items()},
        hosts_current=hosts_current,
    )
    return (
        (str(settings.config_path), "config.cfg", files.config),
        (str(settings.nodes_config_path), "nodes_config.cfg", files.nodes_config),
        (settings.imex.hosts_file, "hosts", files.hosts),
    )
