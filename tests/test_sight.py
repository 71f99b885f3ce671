"""What one node sees of its domain: `fleet.links` over its `ctl -N -j` table."""

from __future__ import annotations

import json
from typing import Any

from imexd.daemon.ctl import parse_domain_json
from imexd.health import fleet

NAMES = {0: "n0", 1: "n1", 2: "n2"}


def _view(states: dict[int, str], links: dict[tuple[int, int], str]) -> str:
    nodes: dict[str, Any] = {}
    for i, state in states.items():
        connections = {
            str(j): {"host": f"h{j}", "status": links.get((i, j), "CONNECTED"), "changed": False}
            for j in states
        }
        nodes[str(i)] = {
            "status": state,
            "host": f"h{i}",
            "hostName": "N/A",
            "version": "570.172",
            "connections": connections if state == "READY" else {},
        }
    return json.dumps({"timestamp": "t", "status": "DEGRADED", "nodes": nodes})


def test_all_connected_members_are_up() -> None:
    """Three READY members connected both ways: nobody is unreachable."""
    table = parse_domain_json(_view(dict.fromkeys(NAMES, "READY"), {}))
    view = fleet.links(table, NAMES, "names")
    assert view.unreachable == ()
    assert all(s.connected for s in view.slots.values())


def test_a_dead_daemon_is_named_alone() -> None:
    """One member UNAVAILABLE: only it is unreachable, the live ones stay connected."""
    states = {0: "READY", 1: "UNAVAILABLE", 2: "READY"}
    links = {(0, 1): "NEVER_CONNECTED", (2, 1): "NEVER_CONNECTED"}
    view = fleet.links(parse_domain_json(_view(states, links)), NAMES, "names")
    assert view.unreachable == ("n1",)
    assert view.slots[0].connected
    assert view.slots[2].connected
    assert not view.slots[1].connected


def test_a_broken_link_names_both_ends() -> None:
    """A link broken between two live members makes both ends not connected."""
    states = dict.fromkeys(NAMES, "READY")
    table = parse_domain_json(_view(states, {(0, 2): "RECOVERING"}))
    view = fleet.links(table, NAMES, "names")
    assert view.unreachable == ("n0", "n2")
    assert view.slots[1].connected


def test_addresses_mode_indexes_members_in_slot_order() -> None:
    """In addresses mode the table's index i is the i-th member by slot, not the slot."""
    states = {0: "READY", 1: "UNAVAILABLE"}
    table = parse_domain_json(_view(states, {(0, 1): "NEVER_CONNECTED"}))
    view = fleet.links(table, {3: "n3", 7: "n7"}, "addresses")
    assert view.unreachable == ("n7",)
    assert view.slots[3].connected
    assert view.slots[7].status == "UNAVAILABLE"
