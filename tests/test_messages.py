"""The wire contract: addresses checked at the boundary, the presence record, topics."""

from __future__ import annotations

import ipaddress
import json
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from imexd import messages, topics
from imexd.imex import EMPTY_SLOT_ADDRESS
from imexd.messages import (
    Deleted,
    Dropped,
    DropReason,
    HealthReport,
    MemberRecord,
    MemberState,
    Presence,
    Received,
    Retry,
    WorkloadRecord,
    address_problem,
    check_topic,
    decode,
    decode_message,
    encode,
    json_schemas,
)
from imexd.topics import TopicRef, Topics, decode_level, encode_level

TOPICS = Topics("imex/v2")
INJECTED = "fe80::1%x\n10.66.6.6 imex-00000000-0000 login-node"


def member(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": 1,
        "node": "n1",
        "domain": "d1",
        "clique": "c.1",
        "address": "10.0.0.1",
        "slot": 0,
        "incarnation": 1,
        "state": "member",
        "max_nodes": 8,
        "mode": "names",
    }
    body.update(fields)
    return body


def health(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": 1,
        "node": "n1",
        "domain": "d1",
        "clique": "c.1",
        "slot": 0,
        "incarnation": 1,
        "at": 1.0,
        "ready": True,
        "conditions": [],
        "daemon": {"state": "RUNNING"},
    }
    body.update(fields)
    return body


def raw(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


BAD_ADDRESSES = [
    (EMPTY_SLOT_ADDRESS, "sentinel"),
    (INJECTED, "zone id"),
    ("fe80::1%eth0", "zone id"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"),
    ("2001:DB8::1", "not canonical"),
    ("2001:db8:0::1", "not canonical"),
    ("::ffff:10.0.0.1", "IPv4-mapped"),
    ("10.0.0.1 ", "not an IP address"),
    ("10.0.0.1\n", "not an IP address"),
    ("host.example", "not an IP address"),
]


@pytest.mark.parametrize(("address", "why"), BAD_ADDRESSES)
def test_a_member_record_with_a_refused_address_is_dropped(address: str, why: str) -> None:
    """A member record whose address is refused decodes to a Dropped naming the problem."""
    got = decode(raw(member(address=address)), MemberRecord)
    assert isinstance(got, Dropped)
    assert got.reason is DropReason.ADDRESS
    assert why in got.detail
    assert "\n" not in got.detail


@pytest.mark.parametrize(("address", "why"), BAD_ADDRESSES)
def test_a_health_report_with_a_refused_address_is_dropped(address: str, why: str) -> None:
    """A health report's non-empty address is held to the member record's rule."""
    got = decode(raw(health(address=address)), HealthReport)
    assert isinstance(got, Dropped)
    assert (got.reason, why in got.detail) == (DropReason.ADDRESS, True)


def test_a_health_report_without_an_address_is_fine() -> None:
    """An empty HealthReport.address means "unknown" and is accepted."""
    got = decode(raw(health()), HealthReport)
    assert isinstance(got, HealthReport)
    assert got.address == ""


@pytest.mark.parametrize("address", ["10.0.0.1", "127.0.0.5", "2001:db8::1", "fe80::1", "::1"])
def test_canonical_unicast_addresses_pass(address: str) -> None:
    """Canonical IPv4 and zone-less IPv6 addresses decode (loopback: the simulator)."""
    got = decode(raw(member(address=address)), MemberRecord)
    assert isinstance(got, MemberRecord)
    assert got.address == address


@pytest.mark.parametrize(("address", "_"), BAD_ADDRESSES)
def test_a_refused_address_cannot_be_built_either(address: str, _: str) -> None:
    """The same rule holds for records built in code, not only for decoded ones."""
    with pytest.raises(ValueError, match="address"):
        MemberRecord(**{k: v for k, v in member(address=address).items() if k != "v"})


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses())
def test_every_accepted_address_is_its_own_canonical_form(ip: Any) -> None:
    """An accepted address is exactly what ipaddress prints and one token."""
    text = str(ip)
    problem = address_problem(text)
    if problem is None:
        assert str(ipaddress.ip_address(text)) == text
        assert text.split() == [text]
        assert not ip.is_multicast
        assert not ip.is_unspecified
    else:
        assert (
            ip.is_multicast
            or ip.is_unspecified
            or text == EMPTY_SLOT_ADDRESS
            or (ip.version == 6 and ip.ipv4_mapped is not None)
        )


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=64))
def test_decoding_any_address_never_raises(address: str) -> None:
    """Whatever the address text, decode returns a record or a Dropped."""
    got = decode(raw(member(address=address)), MemberRecord)
    if isinstance(got, MemberRecord):
        assert address_problem(got.address) is None
    else:
        assert got.reason in (DropReason.ADDRESS, DropReason.SCHEMA)


def test_settled_round_trips_and_defaults_to_none() -> None:
    """`settled` is optional on the wire (old agents) and kept when present."""
    old = decode(raw(member()), MemberRecord)
    assert isinstance(old, MemberRecord)
    assert old.settled is None
    new = decode(raw(member(settled=1700000000.5)), MemberRecord)
    assert isinstance(new, MemberRecord)
    assert new.settled == 1700000000.5
    assert decode(encode(new), MemberRecord) == new


# Presence


def presence(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": 1,
        "node": "n1",
        "incarnation": 3,
        "at": 1700000000.0,
        "domain": None,
        "address": "10.0.0.1",
    }
    body.update(fields)
    return body


def test_presence_topic_round_trip() -> None:
    """The presence topic is built and parsed back; its filter matches every node."""
    topic = TOPICS.presence("ip-10-0-1-2.ec2.internal")
    assert topic == "imex/v2/nodes/ip-10-0-1-2%2Eec2%2Einternal/presence"
    assert TOPICS.parse(topic) == TopicRef("presence", node="ip-10-0-1-2.ec2.internal")


def test_presence_decodes_and_must_match_its_topic() -> None:
    """A presence decodes strictly and may only speak for the node its topic names."""
    got = decode(raw(presence(domain="d1")), Presence)
    assert got == Presence(
        node="n1", incarnation=3, at=1700000000.0, domain="d1", address="10.0.0.1"
    )
    assert isinstance(got, Presence)
    assert check_topic(TopicRef("presence", node="n1"), got) is None
    assert check_topic(TopicRef("presence", node="n2"), got) == "presence says n1, topic says n2"
    assert decode(encode(got), Presence) == got


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"address": EMPTY_SLOT_ADDRESS}, DropReason.ADDRESS),
        ({"address": INJECTED}, DropReason.ADDRESS),
        ({"address": ""}, DropReason.SCHEMA),
        ({"node": "Not_A_Node"}, DropReason.SCHEMA),
        ({"domain": "D1"}, DropReason.SCHEMA),
        ({"at": "yesterday"}, DropReason.SCHEMA),
        ({"v": 2}, DropReason.VERSION),
    ],
)
def test_a_wrong_presence_is_dropped(fields: dict[str, Any], reason: DropReason) -> None:
    """Each wrong presence maps to its DropReason."""
    got = decode(raw(presence(**fields)), Presence)
    assert isinstance(got, Dropped)
    assert got.reason is reason


def test_presence_has_a_schema_that_requires_every_field() -> None:
    """Presence ships a JSON Schema like the other retained payloads."""
    schema = json_schemas()["Presence"]["$defs"]["Presence"]
    assert schema["required"] == ["address", "at", "domain", "incarnation", "node", "v"]
    member_schema = json_schemas()["MemberRecord"]["$defs"]["MemberRecord"]
    assert "settled" in member_schema["properties"]
    assert "settled" not in member_schema["required"]


@pytest.mark.parametrize("state", ["claiming", "member", "leaving"])
def test_only_a_standby_record_can_be_released(state: str) -> None:
    """`released` means "standby and seeking no slot": on other states it is refused."""
    got = decode(raw(member(state=state, released=True)), MemberRecord)
    assert isinstance(got, Dropped)
    assert got.reason is DropReason.SCHEMA
    ok = decode(raw(member(state="standby", slot=None, released=True)), MemberRecord)
    assert isinstance(ok, MemberRecord)
    assert ok.released


def test_a_lost_record_carries_hold_s_and_needs_no_slot() -> None:
    """The tombstone (state lost) decodes without a slot and with hold_s; its schema
    lists the state and the field."""
    got = decode(raw(member(state="lost", slot=None, hold_s=5.0)), MemberRecord)
    assert isinstance(got, MemberRecord)
    assert (got.state, got.slot, got.hold_s) == (MemberState.LOST, None, 5.0)
    schema = json_schemas()["MemberRecord"]["$defs"]
    assert "lost" in schema["MemberState"]["enum"]
    assert schema["MemberRecord"]["properties"]["hold_s"]["minimum"] == 0


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"state": "member", "hold_s": 5.0}, "a member record cannot have hold_s 5.0"),
        ({"state": "lost", "slot": None, "hold_s": -1}, "Expected `float` >= 0.0 - at `$.hold_s`"),
    ],
)
def test_hold_s_is_for_lost_records_only_and_never_negative(
    fields: dict[str, Any], why: str
) -> None:
    """hold_s on a live record, or below 0, is dropped naming the value."""
    got = decode(raw(member(**fields)), MemberRecord)
    assert isinstance(got, Dropped)
    assert got.reason is DropReason.SCHEMA
    assert why in got.detail


# Workload records: a hostile or mistaken one is dropped before any agent acts on it.


def workload(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": 1,
        "workload": "job-7",
        "domain": "d1",
        "channel": 3,
        "nodes": ["n1", "n2"],
        "uid": 1000,
        "gid": 1000,
        "mode": 0o660,
        "state": "active",
        "generation": 1,
    }
    body.update(fields)
    return body


def test_workload_topic_round_trip_and_decode() -> None:
    """The workload topic is built and parsed back, and a record decodes strictly."""
    topic = TOPICS.workload("d1", "job-7")
    assert topic == "imex/v2/domains/d1/workloads/job-7"
    assert TOPICS.workloads_filter("+") == "imex/v2/domains/+/workloads/+"
    assert TOPICS.parse(topic) == TopicRef("workload", domain="d1", workload="job-7")
    got = decode_message(TOPICS, topic, raw(workload()), retained=True)
    assert isinstance(got, Received)
    record = got.payload
    assert isinstance(record, WorkloadRecord)
    assert (record.channel, record.mode, record.lists("n2"), record.lists("n3")) == (
        3,
        0o660,
        True,
        False,
    )
    assert WorkloadRecord(workload="w", domain="d", channel=1).lists("any-node")
    deleted = decode_message(TOPICS, topic, b"", retained=False)
    assert isinstance(deleted, Deleted)
    assert deleted.ref.workload == "job-7"


@pytest.mark.parametrize(
    ("topic", "fields", "reason"),
    [
        # A record may only be published on its own topic: no channel taken in another's name.
        ("imex/v2/domains/d1/workloads/job-8", {}, DropReason.TOPIC_MISMATCH),
        ("imex/v2/domains/d2/workloads/job-7", {}, DropReason.TOPIC_MISMATCH),
        ("imex/v2/domains/d1/workloads/Job_7", {}, DropReason.UNKNOWN_TOPIC),
        ("imex/v2/domains/d1/workloads/job-7", {"channel": -1}, DropReason.SCHEMA),
        ("imex/v2/domains/d1/workloads/job-7", {"channel": 1 << 20}, DropReason.SCHEMA),
        ("imex/v2/domains/d1/workloads/job-7", {"mode": 0o4777}, DropReason.SCHEMA),
        ("imex/v2/domains/d1/workloads/job-7", {"uid": -1}, DropReason.SCHEMA),
        ("imex/v2/domains/d1/workloads/job-7", {"uid": 1 << 32}, DropReason.SCHEMA),
        ("imex/v2/domains/d1/workloads/job-7", {"nodes": ["../../etc"]}, DropReason.SCHEMA),
        ("imex/v2/domains/d1/workloads/job-7", {"state": "forced"}, DropReason.SCHEMA),
        ("imex/v2/domains/d1/workloads/job-7", {"v": 2}, DropReason.VERSION),
    ],
)
def test_a_wrong_workload_record_is_dropped(
    topic: str, fields: dict[str, Any], reason: DropReason
) -> None:
    """Each hostile or mistaken workload record maps to its DropReason."""
    got = decode_message(TOPICS, topic, raw(workload(**fields)), retained=True)
    assert isinstance(got, Dropped), got
    assert got.reason is reason


def test_workload_record_has_a_schema() -> None:
    """WorkloadRecord ships a JSON Schema; the wire requires v, workload, domain, channel."""
    schema = json_schemas()["WorkloadRecord"]["$defs"]["WorkloadRecord"]
    assert schema["required"] == ["channel", "domain", "v", "workload"]
    assert schema["properties"]["mode"]["maximum"] == 0o777


# Portable topic levels (issue 13): no `.`, `/`, `+`, `#` or space in any level.


@pytest.mark.parametrize(
    ("name", "level"),
    [
        ("gpu-01", "gpu-01"),
        ("ip-10-0-1-2.ec2.internal", "ip-10-0-1-2%2Eec2%2Einternal"),
        ("b3c1d2e4-0000-4000-8000-00000000beef.7", "b3c1d2e4-0000-4000-8000-00000000beef%2E7"),
        ("A_b", "A_b"),
        ("a/b+c#d e%f", "a%2Fb%2Bc%23d%20e%25f"),
        ("é", "%C3%A9"),
        ("", ""),
    ],
)
def test_a_name_is_one_portable_level(name: str, level: str) -> None:
    """Every character but letters, digits, '-' and '_' is escaped, and decodes back."""
    assert encode_level(name) == level
    assert decode_level(level) == name


@pytest.mark.parametrize(
    "level",
    ["c0ffee.1", "c0ffee%2e1", "gpu%2D01", "%", "%2", "%ZZ", "%FF", "a b", "a+b", "a#b"],
)
def test_a_level_that_is_not_the_one_spelling_of_a_name_is_refused(level: str) -> None:
    """A raw dot, lower-case hex, an escaped safe character, a broken escape or bad UTF-8:
    two spellings of one node would be two topics and two records for one node."""
    assert decode_level(level) is None
    assert TOPICS.parse(f"imex/v2/domains/d1/members/{level}/n1") is None
    assert TOPICS.parse(f"imex/v2/nodes/{level}/presence") is None


@given(st.text(max_size=40))
@settings(max_examples=300)
def test_every_name_round_trips_through_its_level(name: str) -> None:
    """Whatever the name, its level holds none of the characters brokers treat specially
    and decodes back to it."""
    level = encode_level(name)
    assert not set(level) & set("./+# \x00")
    assert decode_level(level) == name


@given(st.text(max_size=40))
@settings(max_examples=300)
def test_a_level_escapes_each_utf8_byte_of_each_unsafe_character(name: str) -> None:
    """encode_level is the contract's rule written out one character at a time."""
    safe = set(string.ascii_letters + string.digits + "-_")
    spelled = "".join(c if c in safe else "".join(f"%{b:02X}" for b in c.encode()) for c in name)
    assert encode_level(name) == spelled


def test_topics_encode_names_and_parse_them_back() -> None:
    """A dotted clique and node make dot-free topics; parse gives the plain names back;
    a wildcard passed as a name stays a wildcard."""
    clique, node = "c0ffee.1", "ip-10-0-1-2.ec2.internal"
    topic = TOPICS.member("d1", clique, node)
    assert topic == "imex/v2/domains/d1/members/c0ffee%2E1/ip-10-0-1-2%2Eec2%2Einternal"
    assert "." not in topic
    assert TOPICS.parse(topic) == TopicRef("member", domain="d1", clique=clique, node=node)
    assert TOPICS.members_filter("d1", clique) == "imex/v2/domains/d1/members/c0ffee%2E1/+"
    assert TOPICS.members_filter("d1", "") == "imex/v2/domains/d1/members/none/+"
    assert TOPICS.members_filter("+", "+") == "imex/v2/domains/+/members/+/+"
    assert TOPICS.parse("imex/v2/domains/d1/members/none/n1") == TopicRef(
        "member", domain="d1", clique="", node="n1"
    )
    assert TOPICS.health("d1", node).endswith("/health/ip-10-0-1-2%2Eec2%2Einternal")
    assert TOPICS.parse(TOPICS.assignment(node)) == TopicRef("assignment", node=node)


def test_a_record_on_a_raw_dotted_topic_is_dropped() -> None:
    """A v1-style topic with a raw dot is not a topic of the contract any more."""
    body = raw(member(clique="c.1"))
    got = decode_message(TOPICS, "imex/v2/domains/d1/members/c.1/n1", body, retained=True)
    assert isinstance(got, Dropped)
    assert got.reason is DropReason.UNKNOWN_TOPIC
    good = decode_message(TOPICS, TOPICS.member("d1", "c.1", "n1"), body, retained=True)
    assert isinstance(good, Received)


def test_remembered_address_verdicts_stay_bounded_and_equal_fresh_ones() -> None:
    """Verdicts are remembered per address, at most ADDRESS_CACHE_SIZE of them, and a
    hostile sender of ever new (or very long) addresses cannot grow that."""
    remembered = messages._remembered_address_problem
    for i in range(messages.ADDRESS_CACHE_SIZE + 500):
        address = f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"
        assert address_problem(address) == messages._address_problem(address)
        assert address_problem(f"x{i}") == f"address {'x' + str(i)!r} is not an IP address"
    assert remembered.cache_info().currsize <= messages.ADDRESS_CACHE_SIZE
    before = remembered.cache_info().currsize
    long = "1" * (messages.ADDRESS_CACHE_MAX_LEN + 1)
    assert address_problem(long) == f"address {long!r} is not an IP address"
    assert remembered.cache_info().currsize == before
    # A remembered verdict is the verdict: a refused address stays refused.
    for _ in range(2):
        assert address_problem("224.0.0.1") == "address '224.0.0.1' is multicast"
        assert address_problem("10.0.0.1") is None


def test_remembered_topics_stay_bounded_and_parse_as_fresh_ones() -> None:
    """Topics are parsed once per distinct topic, at most TOPIC_CACHE_SIZE remembered; a
    flood of new topics (or very long ones) cannot grow that, and each is still judged."""
    remembered = topics._remembered_route
    for i in range(topics.TOPIC_CACHE_SIZE + 500):
        topic = f"imex/v2/domains/d1/members/c%2E1/n{i}"
        assert TOPICS.parse(topic) == TopicRef("member", domain="d1", clique="c.1", node=f"n{i}")
        bad = f"imex/v2/domains/d1/members/c%2E1/N{i}"
        got = decode_message(TOPICS, bad, raw(member()), retained=False)
        assert isinstance(got, Dropped)
        assert got.reason is DropReason.UNKNOWN_TOPIC
    assert remembered.cache_info().currsize <= topics.TOPIC_CACHE_SIZE
    before = remembered.cache_info().currsize
    long = "imex/v2/domains/d1/members/c%2E1/" + "n" * topics.TOPIC_CACHE_MAX_LEN
    assert TOPICS.parse(long) == TopicRef(
        "member", domain="d1", clique="c.1", node="n" * topics.TOPIC_CACHE_MAX_LEN
    )
    got = decode_message(TOPICS, long, raw(member()), retained=False)
    assert isinstance(got, Dropped)  # a node name longer than 253 characters
    assert remembered.cache_info().currsize == before
    # The same topic under another prefix is another topic.
    assert Topics("imex/v3").parse("imex/v2/nodes/n1/ping") is None
    assert TOPICS.parse("imex/v2/nodes/n1/ping") == TopicRef("ping", node="n1")


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(["10.0.0.1", "::1", "member", "claiming", "names", "", "n1", "d1"]),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([(MemberRecord, member), (HealthReport, health)]),
    st.dictionaries(
        st.sampled_from(["v", "node", "domain", "clique", "address", "slot", "state", "at"])
        | st.text(max_size=8),
        JSON_VALUES,
        max_size=3,
    ),
)
def test_the_one_pass_decode_says_what_the_stepwise_one_says(
    kind_and_body: Any, changes: dict[str, Any]
) -> None:
    """The typed one-pass decoder accepts exactly what the stepwise checks accept, with
    the same result, and a bad payload gets the stepwise reason and detail."""
    kind, body = kind_and_body
    payload = raw(body(**changes))
    assert decode(payload, kind) == messages._decode_stepwise(payload, kind)


RETRY: dict[str, Any] = {
    "v": 1,
    "node": "n2",
    "domain": "d1",
    "at": 1767000000.0,
    "by": "imexd-ctl-1",
}


@pytest.mark.parametrize(
    ("topic", "fields", "reason"),
    [
        ("imex/v2/domains/d1/retry/n2", {}, None),
        # A request names the node and domain of its topic: none for a peer in its name.
        ("imex/v2/domains/d1/retry/n3", {}, DropReason.TOPIC_MISMATCH),
        ("imex/v2/domains/d2/retry/n2", {}, DropReason.TOPIC_MISMATCH),
        ("imex/v2/domains/d1/retry/n2", {"at": "now"}, DropReason.SCHEMA),
        ("imex/v2/domains/d1/retry/n2", {"by": "x" * 129}, DropReason.SCHEMA),
        ("imex/v2/domains/d1/retry/n2", {"node": None}, DropReason.SCHEMA),
    ],
)
def test_a_retry_request_decodes_only_on_its_own_topic(
    topic: str, fields: dict[str, Any], reason: DropReason | None
) -> None:
    """`imexd node retry`'s request: built and parsed back; a wrong one is dropped."""
    assert TOPICS.retry("d1", "n2") == "imex/v2/domains/d1/retry/n2"
    assert TOPICS.parse(topic) == TopicRef(
        "retry", domain=topic.split("/")[3], node=topic.split("/")[5]
    )
    got = decode_message(TOPICS, topic, json.dumps({**RETRY, **fields}).encode(), retained=True)
    if reason is None:
        assert isinstance(got, Received), got
        assert got.payload == Retry(node="n2", domain="d1", at=RETRY["at"], by="imexd-ctl-1")
    else:
        assert isinstance(got, Dropped), got
        assert got.reason is reason, got
