# mypy: disable-error-code="no-untyped-call"
# (paho's Properties are untyped: every test here calls them)
"""The MQTT boundary's own rules: topic matching, and paho's lightened Properties.

Both exist for speed (docs/performance.md); these tests hold them to the behaviour of the
library code they stand in for.
"""

from __future__ import annotations

import aiomqtt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from paho.mqtt import MQTTException
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from imexd import mqtt
from imexd.mqtt import topic_matches

LEVEL = st.sampled_from(["a", "b", "c", "", "imex", "n1%2Ex", "$SYS"])
TOPIC = st.lists(LEVEL, min_size=1, max_size=5).map("/".join).filter(bool)


@st.composite
def topic_filter(draw: st.DrawFn) -> str:
    """A valid filter: levels, `+` anywhere, `#` only last, sometimes a shared one."""
    levels = draw(st.lists(st.one_of(LEVEL, st.just("+")), min_size=1, max_size=5))
    if draw(st.booleans()):
        levels.append("#")
    text = "/".join(levels)
    if not text:
        text = "+"  # an empty filter is no filter
    if draw(st.integers(0, 9)) == 0:
        text = f"$share/group/{text}"
    return text


@given(topic_filter(), TOPIC)
def test_topic_matching_is_aiomqtts_rule(pattern: str, topic: str) -> None:
    """Every valid filter and topic match exactly when aiomqtt says they do."""
    assert topic_matches(pattern, topic) == aiomqtt.Topic(topic).matches(pattern)


def test_topic_matching_edge_cases() -> None:
    """`a/#` covers `a`, `+` needs a level, and a shared filter is matched without its
    `$share/<group>/` head (also when it equals the topic's text)."""
    assert topic_matches("a/#", "a")
    assert topic_matches("#", "a/b")
    assert not topic_matches("a/+", "a")
    assert topic_matches("a/+/", "a/b/")
    assert topic_matches("$share/g/a/+", "a/b")
    assert not topic_matches("$share/g/a", "$share/g/a")


# paho's Properties.


def paho_properties(packet_type: int) -> Properties:
    """A Properties made by paho's own constructor (as before the lightening)."""
    props = object.__new__(Properties)
    Properties._imexd_paho_init(props, packet_type)  # type: ignore[attr-defined]
    return props


CASES: list[tuple[int, dict[str, object]]] = [
    (PacketTypes.PUBLISH, {}),
    (
        PacketTypes.PUBLISH,
        {
            "PayloadFormatIndicator": 1,
            "MessageExpiryInterval": 90,
            "ContentType": "application/json",
            "ResponseTopic": "a/b",
            "CorrelationData": b"\x00\x01",
            "TopicAlias": 3,
            "UserProperty": [("k", "v"), ("k", "w")],
        },
    ),
    (
        PacketTypes.CONNECT,
        {
            "SessionExpiryInterval": 2,
            "ReceiveMaximum": 20,
            "MaximumPacketSize": 65536,
            "RequestProblemInformation": 0,
        },
    ),
    (PacketTypes.WILLMESSAGE, {"WillDelayInterval": 2, "MessageExpiryInterval": 5}),
    (PacketTypes.PUBACK, {"ReasonString": "not authorized", "UserProperty": ("a", "b")}),
]


def test_paho_properties_are_lightened() -> None:
    """On the installed paho the lightening applies (else only speed would be lost)."""
    assert mqtt.LIGHT_PROPERTIES


@pytest.mark.parametrize(("packet_type", "values"), CASES)
def test_light_properties_pack_and_unpack_like_pahos(
    packet_type: int, values: dict[str, object]
) -> None:
    """Set, packed, unpacked into an object that held other properties, printed and
    cleared: a lightened Properties behaves like one that paho's constructor made."""
    light, heavy = Properties(packet_type), paho_properties(packet_type)
    for name, value in values.items():
        setattr(light, name, value)
        setattr(heavy, name, value)
    wire = heavy.pack()
    assert light.pack() == wire
    assert light.json() == heavy.json()
    assert str(light) == str(heavy)
    assert light.isEmpty() == heavy.isEmpty() == (not values)
    for target in (Properties(packet_type), paho_properties(packet_type)):
        target.UserProperty = ("left", "from before")  # unpack must clear it
        _, length = target.unpack(wire[:])
        assert length == len(wire)
        assert target.json() == heavy.json()
    light.clear()
    Properties._imexd_paho_clear(heavy)  # type: ignore[attr-defined]
    assert light.isEmpty()
    assert heavy.isEmpty()
    assert light.__dict__.keys() == heavy.__dict__.keys()


def test_light_properties_still_refuse_what_paho_refuses() -> None:
    """Validation is paho's own: an unknown name, or one that does not fit the packet."""
    props = Properties(PacketTypes.PUBLISH)
    with pytest.raises(MQTTException):
        props.NoSuchProperty = 1
    with pytest.raises(MQTTException):
        props.SessionExpiryInterval = 1


def test_the_shared_tables_stay_as_paho_builds_them() -> None:
    """Using many lightened Properties leaves the tables they share as a fresh paho
    constructor would build them."""
    for packet_type, values in CASES * 3:
        props = Properties(packet_type)
        for name, value in values.items():
            setattr(props, name, value)
        props.unpack(props.pack())
        props.clear()
    fresh = paho_properties(PacketTypes.PUBLISH)
    shared = Properties(PacketTypes.PUBLISH)
    for table in ("types", "names", "properties"):
        assert getattr(shared, table) == getattr(fresh, table)
