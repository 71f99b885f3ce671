"""MQTT client ids derived from node names (`names.client_id`): any node name connects.

nats-server 2.14 refuses a client id holding a dot at CONNECT (`invalid character in
client ID`), and node names are often FQDNs; a unicode or very long name is no better
for a broker that keeps to MQTT's promise of letters and digits. The ids must stay
stable per node (the broker session and the duplicate check hang on them), distinct
between nodes, and readable in broker logs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from imexd.bus.mqtt import connect
from imexd.names import CLIENT_ID_MAX, client_id
from imexd.settings import BusSettings, parse_broker_url
from tests import nats_builds
from tests.brokers import Mosquitto
from tests.cluster import Cluster, formed
from tests.nats_servers import Nats

VALID = re.compile(r"^[A-Za-z0-9_-]+$")

NAMES = [
    "n1",
    "n0027.c01.scale",
    "n0027-c01-scale",
    "gpu-node-17.rack-b.cluster.example.com",
    "x" * 120,
    "x" * 121,
    "nœud-é.例え",
    "nœud-e.例え",
]
"""Plain, dotted, the dotted one's dash-spelled twin, an FQDN, two long names that share
their first 120 characters, and two unicode names that differ in one letter."""


def test_a_plain_name_keeps_its_id() -> None:
    assert client_id("imexd", "n1") == "imexd-n1"
    assert client_id("imexd", "gpu_07-a") == "imexd-gpu_07-a"


@pytest.mark.parametrize("name", NAMES)
def test_each_id_is_valid_short_stable_and_readable(name: str) -> None:
    derived = client_id("imexd", name)
    assert VALID.match(derived), derived
    assert len(derived) <= CLIENT_ID_MAX
    assert derived == client_id("imexd", name), "the same node gets the same id"
    readable = re.sub(r"[^A-Za-z0-9_-]+", "-", name)[:20].rstrip("-")
    assert derived.startswith(f"imexd-{readable}"), "its ASCII letters and digits stay"


def test_distinct_names_get_distinct_ids() -> None:
    ids = [client_id("imexd", name) for name in NAMES]
    assert len(set(ids)) == len(NAMES), ids
    assert client_id("imexd", "n0027.c01.scale").startswith("imexd-n0027-c01-scale-")


@pytest.fixture(params=["mosquitto", *nats_builds.PARAMS])
def any_broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mosquitto | Nats]:
    """Mosquitto, then each nats-server build of tests/nats_builds.py."""
    server: Mosquitto | Nats
    if request.param == "mosquitto":
        server = Mosquitto(tmp_path / "mosquitto")
    else:
        server = Nats(tmp_path / "nats", binary=request.param)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_the_broker_accepts_every_derived_id(any_broker: Mosquitto | Nats) -> None:
    url = parse_broker_url(any_broker.url)
    settings = BusSettings(url=(any_broker.url,), protocol="3.1.1")
    for name in NAMES:
        client = await connect(settings, url, client_id=client_id("imexd", name), timeout_s=10.0)
        assert await client.close(5.0) is None, name


@pytest.mark.slow
def test_agents_with_dotted_names_form_a_domain(
    any_broker: Mosquitto | Nats, tmp_path: Path
) -> None:
    """Real agents whose node names are FQDNs connect and form (on NATS too)."""
    cluster = Cluster(tmp_path / "agents", broker=any_broker)
    try:
        nodes = [cluster.add(name) for name in ("n1.rack-a.example.com", "n2.rack-a.example.com")]
        formed(cluster, nodes)
    finally:
        cluster.close()
    assert cluster.forced == []
    for node in nodes:
        assert node.log_problems() == [], node.name
