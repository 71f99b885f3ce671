"""Agent pieces that need no processes: judging the domain probe over the members."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

from imexd.agent import Agent, Desired
from imexd.messages import MemberRecord, MemberState
from imexd.probe import parse_domain_json
from imexd.settings import settings_from_mapping


def _agent(members: dict[int, str]) -> Agent:
    settings = settings_from_mapping(
        {"node": {"name": "n0", "address": "127.0.0.1", "clique": "c1"}}, environ={}
    )
    agent = Agent(settings)
    agent.desired = Desired(
        domain="d1", clique="c1", slot=0, run=True, members=MappingProxyType(members)
    )
    for slot, address in members.items():
        agent.records[f"n{slot}"] = MemberRecord(
            node=f"n{slot}",
            domain="d1",
            clique="c1",
            address=address,
            slot=slot,
            incarnation=1,
            state=MemberState.MEMBER,
            max_nodes=18,
            mode="names",
        )
    return agent


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


MEMBERS = {0: "127.0.0.1", 1: "127.0.0.3", 2: "127.0.0.4"}


def test_all_connected_members_are_up() -> None:
    """Three READY members connected both ways: nobody is unreachable."""
    view = _agent(MEMBERS)._judge_domain(
        parse_domain_json(_view(dict.fromkeys(MEMBERS, "READY"), {}))
    )
    assert view.unreachable == ()
    assert all(s.connected for s in view.slots.values())


def test_a_dead_daemon_is_named_alone() -> None:
    """One member UNAVAILABLE: only it is unreachable, the live ones stay connected."""
    states = {0: "READY", 1: "UNAVAILABLE", 2: "READY"}
    links = {(0, 1): "NEVER_CONNECTED", (2, 1): "NEVER_CONNECTED"}
    view = _agent(MEMBERS)._judge_domain(parse_domain_json(_view(states, links)))
    assert view.unreachable == ("n1",)
    assert view.slots[0].connected
    assert view.slots[2].connected
    assert not view.slots[1].connected


def test_a_broken_link_names_both_ends() -> None:
    """A link broken between two live members makes both ends not connected."""
    states = dict.fromkeys(MEMBERS, "READY")
    view = _agent(MEMBERS)._judge_domain(parse_domain_json(_view(states, {(0, 2): "RECOVERING"})))
    assert view.unreachable == ("n0", "n2")
    assert view.slots[1].connected
