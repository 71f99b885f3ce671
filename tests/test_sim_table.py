"""The simulator's `-N` renderings against the real outputs kept in tests/fixtures/imex.

These are the formats the agent's parsers are written against, so the simulator must
reproduce them line by line where they are fixed: the legend, the `Node #` lines, the
matrix and the `Domain State:` line, and the JSON keys at every level.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from imexd.sim.command import Cell, LinkStatus, NodeState, NodeStatus
from imexd.sim.table import (
    LEGEND,
    DomainView,
    NodeRow,
    build_view,
    format_timestamp,
    node_row,
    render_json,
    render_text,
)

FIXTURES = Path(__file__).parent / "fixtures" / "imex"
SAMPLE = (FIXTURES / "ctl-N-570.172.txt").read_text()

NODE_LINE = re.compile(
    r"^Node #(?P<id>\d+)\s+(?P<mark>[-*]) (?P<host>\S+)(?: \*)?\s+- (?P<state>[A-Z_]+)"
    r"(?:\s+- Version: (?P<version>\S+))?$"
)
HEADER = re.compile(r"^ Nodes From\\To  \d+(?:   \d+|  \d{2}| \d{3})*$")
CELL = r"(?:C|N|I|R|D|A|!V!|!M!)"
ROW = re.compile(rf"^\s+(?P<id>\d+) {{8}}{CELL}(?:\s+{CELL})*$")
TIMESTAMP = re.compile(r"^\d{1,2}/\d{1,2}/\d{4} \d{2}:\d{2}:\d{2}\.\d{3}$")
DOMAIN = re.compile(r"^Domain State: (UP|DEGRADED|DOWN)$")

CONNECTED = Cell(status=LinkStatus.CONNECTED, changed=True)
NEVER = Cell(status=LinkStatus.NEVER_CONNECTED, changed=False)


def reply(node: int, links: list[Cell], *, state: NodeState = NodeState.READY) -> NodeStatus:
    return NodeStatus(
        node=node,
        state=state,
        version="570.172",
        cmd_port=50005,
        nodes=["gpu-a", "gpu-b", "gpu-c"],
        links=links,
    )


def three_nodes(
    *, peer2: NodeStatus | None, local_state: NodeState = NodeState.READY
) -> DomainView:
    local = reply(0, [CONNECTED, CONNECTED, CONNECTED], state=local_state)
    peers: dict[int, NodeStatus | None] = {1: reply(1, [CONNECTED] * 3), 2: peer2}
    addresses = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    return build_view(local=local, addresses=addresses, peers=peers, at=1764455833.561)


def test_the_570_172_sample_is_reproduced_byte_for_byte() -> None:
    """Given the sample's data and clock, the text is exactly the real daemon's."""
    rows = tuple(
        NodeRow(
            index=i,
            host=host,
            host_name="N/A",
            state="READY",
            version="570.172",
            links=(CONNECTED, CONNECTED),
        )
        for i, host in enumerate(["172.31.48.81", "172.31.48.82"])
    )
    view = DomainView(timestamp="5/4/2026 06:08:10.580", local=None, nodes=rows)
    assert render_text(view) == SAMPLE


def test_the_legend_is_the_real_one_verbatim() -> None:
    """The legend lines (typo included) are the sample's first nine lines."""
    assert list(LEGEND) == SAMPLE.splitlines()[:9]
    text = render_text(three_nodes(peer2=None))
    assert text.splitlines()[:10] == [*SAMPLE.splitlines()[:9], ""]


@pytest.mark.parametrize(
    "fixture", ["ctl-N-570.172.txt", "ctl-N-node-line-570.124.txt", "ctl-N-node-line-local.txt"]
)
def test_node_line_pattern_accepts_every_real_layout(fixture: str) -> None:
    """The pattern used on the simulator's lines accepts all real `Node #` layouts."""
    lines = [ln for ln in (FIXTURES / fixture).read_text().splitlines() if ln.startswith("Node #")]
    assert lines
    assert all(NODE_LINE.match(ln) for ln in lines)


def test_simulated_lines_match_the_sample_patterns_and_columns() -> None:
    """Node lines, matrix header, rows, timestamp and Domain State follow the sample."""
    lines = render_text(three_nodes(peer2=None)).splitlines()
    nodes = [ln for ln in lines if ln.startswith("Node #")]
    assert len(nodes) == 3
    for line in nodes:
        match = NODE_LINE.match(line)
        assert match is not None, line
        assert match["version"] is not None
    sample_line = SAMPLE.splitlines()[12]
    remote = nodes[1]
    assert remote.index("- READY") == sample_line.index("- READY")
    assert remote.index("- Version") == sample_line.index("- Version")
    assert nodes[0].startswith("Node #0   * 10.0.0.1 *")
    assert nodes[2].startswith("Node #2   - 10.0.0.3        - UNAVAILABLE")
    assert TIMESTAMP.match(lines[10])
    assert lines[11] == "Nodes:"
    header = lines.index(" Nodes From\\To  0   1   2")
    assert HEADER.match(lines[header])
    assert HEADER.match(SAMPLE.splitlines()[15])
    assert all(ROW.match(ln) for ln in lines[header + 1 : header + 4])
    assert all(ROW.match(ln) for ln in SAMPLE.splitlines()[16:18])
    assert lines[header + 3] == "       2        I   I   I"
    assert lines[header + 1] == "       0        C   C   C"
    assert DOMAIN.match(lines[-1])
    assert DOMAIN.match(SAMPLE.splitlines()[-1])


def test_matrix_cells_keep_four_character_columns() -> None:
    """`!M!` and two-digit node ids keep the sample's column layout."""
    mismatch = Cell(status=LinkStatus.NODE_MAP_MISMATCH, changed=True)
    rows = tuple(
        NodeRow(
            index=i,
            host=f"10.0.0.{i}",
            host_name="N/A",
            state="READY",
            version="570.172",
            links=tuple(mismatch if j == 11 else CONNECTED for j in range(12)),
        )
        for i in range(12)
    )
    lines = render_text(DomainView(timestamp="1/1/2026 00:00:00.000", local=0, nodes=rows))
    text = lines.splitlines()
    assert " Nodes From\\To  0   1   2   3   4   5   6   7   8   9   10  11" in text
    assert "      11        C   C   C   C   C   C   C   C   C   C   C   !M!" in text
    assert all(ROW.match(ln) for ln in text if ln.startswith("      1"))


def keys_by_level(document: dict[str, Any]) -> list[set[str]]:
    node = next(iter(document["nodes"].values()))
    connection = next(iter(node["connections"].values()))
    return [set(document), set(node), set(connection)]


def test_json_has_the_sample_keys_at_every_level() -> None:
    """`-N -j` uses exactly the real keys: top level, per node and per connection."""
    sample = json.loads((FIXTURES / "ctl-N-j.json").read_text())
    ours = json.loads(render_json(three_nodes(peer2=None)))
    assert keys_by_level(ours) == keys_by_level(sample)
    for node in ours["nodes"].values():
        assert set(node) == set(sample["nodes"]["0"])
        for connection in node["connections"].values():
            assert set(connection) == set(sample["nodes"]["0"]["connections"]["0"])
            assert isinstance(connection["changed"], bool)
    assert ours["status"] == "DEGRADED"
    assert ours["nodes"]["2"]["status"] == "UNAVAILABLE"
    assert {c["status"] for c in ours["nodes"]["2"]["connections"].values()} == {"INVALID"}
    assert ours["nodes"]["0"]["hostName"] == "gpu-a"
    assert TIMESTAMP.match(ours["timestamp"])


def test_json_status_words_include_the_real_ones() -> None:
    """CONNECTED, NEVER_CONNECTED and INVALID are spelled as real output spells them."""
    words = {status.value for status in LinkStatus}
    assert {"CONNECTED", "NEVER_CONNECTED", "INVALID"} <= words


@pytest.mark.parametrize(
    ("peer2", "local_state", "expected"),
    [
        (reply(2, [CONNECTED] * 3), NodeState.READY, "UP"),
        (None, NodeState.READY, "DEGRADED"),
        (reply(2, [CONNECTED, NEVER, CONNECTED]), NodeState.READY, "DEGRADED"),
        (
            reply(2, [CONNECTED] * 3, state=NodeState.WAITING_FOR_RECOVERY),
            NodeState.READY,
            "DEGRADED",
        ),
        (reply(2, [CONNECTED] * 3), NodeState.SHUTTING_DOWN, "DOWN"),
    ],
)
def test_domain_state(peer2: NodeStatus | None, local_state: NodeState, expected: str) -> None:
    """UP needs every node READY and every cell C; a local daemon not READY is DOWN."""
    view = three_nodes(peer2=peer2, local_state=local_state)
    assert view.status == expected
    assert render_text(view).endswith(f"Domain State: {expected}\n")


def test_host_names_are_shown_with_dash_h() -> None:
    """`-H` shows the node list's host names; address entries keep their address."""
    text = render_text(three_nodes(peer2=None), host_names=True)
    assert "Node #1   - gpu-b           - READY" in text
    row = node_row(0, "10.1.1.1", "10.1.1.1", None, 1)
    assert row.host_name == "N/A"
    assert row.version == "N/A"


def test_unresolved_entries_show_the_entry() -> None:
    """An entry that resolves to nothing is shown by its name, as unavailable."""
    row = node_row(3, "imex-abc-0003", None, None, 4)
    assert (row.host, row.state) == ("imex-abc-0003", NodeState.UNAVAILABLE)
    assert {link.status for link in row.links} == {LinkStatus.INVALID}


def test_timestamp_format_is_month_day_year_with_milliseconds() -> None:
    """The clock text has the sample's shape: unpadded month and day, milliseconds."""
    assert TIMESTAMP.match(format_timestamp(1764455833.561))
    assert format_timestamp(1764455833.561).endswith(".561")
