"""The `nvidia-imex-ctl -N` renderings, as pure functions of what the nodes answered.

The agent's parsers are written against real output (tests/fixtures/imex), so the
layout here is the real one, column for column: the legend verbatim (its typo
included), `Node #` lines padded like driver 570.172, the `Nodes From\\To` matrix with
four-character cells, and the JSON keys of `-N -j`. Nothing here does I/O.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

from imexd.sim.cfgfile import is_ip
from imexd.sim.command import Cell, LinkStatus, NodeState, NodeStatus

LEGEND = (
    "Connectivity Table Legend:",
    "I - Invalid - Node wasn't reachable, no connection status available",
    "N - Never Connected",
    "R - Recovering - Connection was lost, but clean up has not yet been triggered.",
    "D - Disconnected - Connection was lost, and clean up has been triggreed.",
    "A - Authenticating - If GSSAPI enabled, client has initiated mutual authentication.",
    "!V! - Version mismatch, communication disabled.",
    "!M! - Node map mismatch, communication disabled.",
    "C - Connected - Ready for operation",
)

NOT_AVAILABLE = "N/A"
"""What `hostName` holds for address entries, and `version` for unreachable nodes."""

_INVALID = Cell(status=LinkStatus.INVALID, changed=False)


def format_timestamp(at: float) -> str:
    """IMEX's clock text, local time: `5/4/2026 06:08:10.580` (month/day unpadded)."""
    t = time.localtime(at)
    millis = int(at * 1000) % 1000
    return f"{t.tm_mon}/{t.tm_mday}/{t.tm_year} {time.strftime('%H:%M:%S', t)}.{millis:03d}"


class NodeRow:
    """One node as `-N` shows it: its line under `Nodes:` and its matrix row (a plain
    class: `-N` imports no dataclasses)."""

    __slots__ = ("host", "host_name", "index", "links", "state", "version")

    def __init__(
        self,
        *,
        index: int,
        host: str,
        host_name: str,
        state: str,
        version: str,
        links: tuple[Cell, ...],
    ) -> None:
        self.index = index
        self.host = host
        """Its address as the ctl resolved it, else the entry itself."""
        self.host_name = host_name
        """The entry when it is a host name, else N/A."""
        self.state = state
        self.version = version
        self.links = links


class DomainView:
    """The whole `-N` answer; `status` is the `Domain State:` word."""

    __slots__ = ("local", "nodes", "timestamp")

    def __init__(self, *, timestamp: str, local: int | None, nodes: tuple[NodeRow, ...]) -> None:
        self.timestamp = timestamp
        self.local = local
        """The node whose command service was asked first: marked with asterisks."""
        self.nodes = nodes

    @property
    def status(self) -> str:
        """UP: all READY and connected; DOWN: the local daemon not READY; else DEGRADED.

        Empty slots (sentinel or unresolvable names) are unavailable nodes, so a
        partly filled names-mode list reads DEGRADED, exactly like the real daemon.
        """
        by_index = {row.index: row for row in self.nodes}
        local = by_index.get(self.local) if self.local is not None else None
        if local is not None and local.state != NodeState.READY:
            return "DOWN"
        if all(
            row.state == NodeState.READY
            and all(link.status == LinkStatus.CONNECTED for link in row.links)
            for row in self.nodes
        ):
            return "UP"
        return "DEGRADED"


def node_row(
    index: int, entry: str, address: str | None, reply: NodeStatus | None, count: int
) -> NodeRow:
    """A row from a node's own status reply; None (unreachable) = UNAVAILABLE, all I."""
    host = address or entry
    host_name = NOT_AVAILABLE if is_ip(entry) else entry
    if reply is None:
        return NodeRow(
            index=index,
            host=host,
            host_name=host_name,
            state=NodeState.UNAVAILABLE,
            version=NOT_AVAILABLE,
            links=(_INVALID,) * count,
        )
    links = tuple(reply.links[:count]) + (_INVALID,) * (count - len(reply.links))
    return NodeRow(
        index=index,
        host=host,
        host_name=host_name,
        state=reply.state,
        version=reply.version,
        links=links,
    )


def build_view(
    *,
    local: NodeStatus,
    addresses: Sequence[str | None],
    peers: Mapping[int, NodeStatus | None],
    at: float,
) -> DomainView:
    """Assemble `-N` from the local reply and each peer's (None = not reachable)."""
    count = len(local.nodes)
    rows = tuple(
        node_row(i, entry, addresses[i], local if i == local.node else peers.get(i), count)
        for i, entry in enumerate(local.nodes)
    )
    return DomainView(timestamp=format_timestamp(at), local=local.node, nodes=rows)


def _node_line(row: NodeRow, *, local: bool, host_names: bool) -> str:
    host = row.host_name if host_names and row.host_name != NOT_AVAILABLE else row.host
    cell = f"* {host} *" if local else f"- {host}"
    pad = max(2 if local else 1, 18 - len(cell))
    return f"Node #{row.index:<4}{cell}{' ' * pad}- {row.state:<21}- Version: {row.version}"


def render_text(view: DomainView, *, host_names: bool = False) -> str:
    """The `-N` text, line for line as driver 570.172 prints it."""
    lines = [*LEGEND, "", view.timestamp, "Nodes:"]
    lines += [
        _node_line(row, local=row.index == view.local, host_names=host_names) for row in view.nodes
    ]
    header = " Nodes From\\To  " + "".join(f"{row.index:<4}" for row in view.nodes)
    lines += ["", header.rstrip()]
    for row in view.nodes:
        cells = "".join(f"{link.status.letter:<4}" for link in row.links)
        lines.append(f"{row.index:>8}        {cells}".rstrip())
    lines.append(f"Domain State: {view.status}")
    return "\n".join(lines) + "\n"


def render_json(view: DomainView) -> str:
    """The `-N -j` document: the real keys at every level, one line."""
    hosts = [row.host for row in view.nodes]
    document = {
        "timestamp": view.timestamp,
        "status": view.status,
        "nodes": {
            str(row.index): {
                "status": row.state,
                "host": row.host,
                "hostName": row.host_name,
                "version": row.version,
                "connections": {
                    str(j): {"host": hosts[j], "status": link.status.value, "changed": link.changed}
                    for j, link in enumerate(row.links)
                },
            }
            for row in view.nodes
        },
    }
    return json.dumps(document, separators=(",", ":")) + "\n"
