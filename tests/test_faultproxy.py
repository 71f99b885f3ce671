"""The fault-injection proxy (tests/faultproxy.py) on real sockets, every wait bounded."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.brokers import Mosquitto
from tests.faultproxy import FaultProxy, Link, Rule
from tests.support import wait_for


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(30)
        try:
            while data := sock.recv(4096):
                sock.sendall(data)
        except OSError:
            pass


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = _Server(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield str(host), int(port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def proxy(echo: tuple[str, int]) -> Iterator[FaultProxy]:
    with FaultProxy(*echo) as p:
        yield p


def connect(p: FaultProxy) -> socket.socket:
    sock = socket.create_connection((p.host, p.port), timeout=5)
    sock.settimeout(5)
    return sock


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def ended(sock: socket.socket, data: bytes) -> bool:
    """Whether the link is gone: a reset, or an orderly close, and never any data."""
    try:
        sock.sendall(data)
        return sock.recv(1) == b""
    except OSError:
        return True


def silent_for(sock: socket.socket, seconds: float) -> bool:
    """True when nothing (no data, no close, no reset) arrives for `seconds`."""
    sock.settimeout(seconds)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(5)
    return False


def test_it_forwards_both_ways_on_a_loopback_address(proxy: FaultProxy) -> None:
    assert proxy.host.startswith("127.")
    assert proxy.url == f"mqtt://{proxy.host}:{proxy.port}"
    with connect(proxy) as sock:
        sock.sendall(b"hello")
        assert recv_exactly(sock, 5) == b"hello"
        assert proxy.connections() == 1
    wait_for(lambda: proxy.connections() == 0, timeout=5)
    assert proxy.bytes_up[0] == 5
    assert proxy.bytes_down[0] == 5


def test_a_delay_holds_each_chunk_and_keeps_the_order(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        proxy.delay(0.5, "up")
        sent = time.monotonic()
        for i in range(5):
            sock.sendall(f"<{i}>".encode())
            time.sleep(0.02)
        assert recv_exactly(sock, 15) == b"<0><1><2><3><4>"
        took = time.monotonic() - sent
        assert 0.45 <= took < 2.0, took
        proxy.delay(0.4, "both")  # each way: the round trip takes about twice as long
        sent = time.monotonic()
        sock.sendall(b"x")
        assert recv_exactly(sock, 1) == b"x"
        assert 0.75 <= time.monotonic() - sent < 2.0
        proxy.heal()
        sent = time.monotonic()
        sock.sendall(b"y")
        assert recv_exactly(sock, 1) == b"y"
        assert time.monotonic() - sent < 0.3


def test_a_drop_is_silent_and_heal_delivers_what_it_held(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        sock.sendall(b"a")
        assert recv_exactly(sock, 1) == b"a"
        proxy.drop()
        sock.sendall(b"bc")
        assert silent_for(sock, 0.6), "a dropped link forwarded data or closed"
        # A new connection is accepted by the proxy but never reaches the other end.
        with connect(proxy) as late:
            late.sendall(b"z")
            assert silent_for(late, 0.3)
            late.close()
        sock.sendall(b"d")
        proxy.heal()
        assert recv_exactly(sock, 3) == b"bcd"
        sock.sendall(b"e")
        assert recv_exactly(sock, 1) == b"e"


def test_a_one_way_drop_holds_only_that_way(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        proxy.drop("down")
        sock.sendall(b"ping")
        assert silent_for(sock, 0.4)
        before = proxy.bytes_up[0]
        assert before == 4, "the way up still forwards"
        proxy.heal()
        assert recv_exactly(sock, 4) == b"ping"


def test_a_cut_resets_every_connection_and_refuses_new_ones(proxy: FaultProxy) -> None:
    sock = connect(proxy)
    sock.sendall(b"a")
    assert recv_exactly(sock, 1) == b"a"
    proxy.cut()
    assert ended(sock, b"b")
    sock.close()
    try:
        refused = socket.create_connection((proxy.host, proxy.port), timeout=5)
    except ConnectionResetError:
        pass  # reset while connect() returned (a loaded machine): refused all the same
    else:
        refused.settimeout(5)
        assert ended(refused, b"c")
        refused.close()
    assert proxy.connections() == 0
    proxy.heal()
    with connect(proxy) as sock:
        sock.sendall(b"d")
        assert recv_exactly(sock, 1) == b"d"


def test_a_drop_then_cut_then_heal_leaves_a_working_proxy(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        proxy.drop()
        sock.sendall(b"lost")
        proxy.cut()
        assert ended(sock, b"x")
    proxy.heal()
    with connect(proxy) as sock:
        sock.sendall(b"ok")
        assert recv_exactly(sock, 2) == b"ok"


def test_end_with_sends_its_bytes_then_closes(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        sock.sendall(b"a")
        assert recv_exactly(sock, 1) == b"a"
        proxy.end_with(b"bye")
        assert recv_exactly(sock, 3) == b"bye"
        assert ended(sock, b"x")
    wait_for(lambda: proxy.connections() == 0, timeout=5)


class _AnswersPings(Rule):
    """Answers a PINGREQ itself, hangs up on a DISCONNECT, passes the rest on."""

    def up(self, packet: bytes, link: Link) -> bytes:
        if packet == b"\xc0\x00":
            link.to_client(b"\xd0\x00")
            return b""
        if packet == b"\xe0\x00":
            link.hang_up()
            return b""
        return packet


def test_a_rule_sees_whole_packets_answers_and_hangs_up(echo: tuple[str, int]) -> None:
    with FaultProxy(*echo, rule=_AnswersPings()) as proxy, connect(proxy) as sock:
        sock.sendall(b"\x30\x03")  # a PUBLISH's fixed header: nothing passes before its body
        assert silent_for(sock, 0.3)
        sock.sendall(b"t\x00!\xc0\x00")
        assert recv_exactly(sock, 7) == b"\xd0\x00\x30\x03t\x00!"  # answered before the echo
        sock.sendall(b"\xe0\x00")
        assert ended(sock, b"x")


def test_an_mqtt_client_works_through_it_and_notices_a_cut(broker: Mosquitto) -> None:
    with FaultProxy(broker.host, broker.port) as p:
        events: list[str] = []
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id="fp", protocol=paho.MQTTv5)
        client.on_connect = lambda *_a: events.append("connect")
        client.on_disconnect = lambda *_a: events.append("disconnect")
        client.connect(p.host, p.port, keepalive=5)
        client.loop_start()
        try:
            wait_for(lambda: "connect" in events, timeout=10)
            p.cut()
            wait_for(lambda: "disconnect" in events, timeout=10)
        finally:
            client.disconnect()
            client.loop_stop()
