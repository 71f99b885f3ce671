"""The simulated ctl's command line: the real flags, and where it finds the daemon."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from imexd.sim.cfgfile import DEFAULT_CONFIG_PATH
from imexd.sim.command import (
    QUERY_FRAME,
    QUERY_REPLIES,
    CmdTarget,
    CommandError,
    LinkStatus,
    NodeState,
    NodeStatus,
    decode_status,
    exchange_all,
    target_from_config,
)
from imexd.sim.ctl import UsageError, main, parse_args, query
from imexd.sim.protocol import (
    Link,
    QueryReply,
    QueryRequest,
    StatusReply,
    decode_reply,
    encode,
)

ROOT = Path(__file__).resolve().parent.parent


def test_flags_of_the_real_tool() -> None:
    """`-i IP PORT`, `-u PATH`, `-c CFG`, `-N -j -H`, `-t MS`; `-c` has the package default."""
    args = parse_args(["-N", "-j", "-H", "-t", "250", "-i", "10.0.0.1", "50005"])
    assert args is not None
    assert (args.mode, args.json, args.host_names, args.timeout_s) == ("N", True, True, 0.25)
    assert args.target == CmdTarget(host="10.0.0.1", port=50005)
    query = parse_args(["-q"])
    assert query is not None
    assert (query.config, query.target, query.timeout_s) == (DEFAULT_CONFIG_PATH, None, 5.0)
    unix = parse_args(["-u", "/run/imex.sock", "-n"])
    assert unix is not None
    assert unix.target == CmdTarget(path="/run/imex.sock")
    assert parse_args(["-h"]) is None


@pytest.mark.parametrize(
    "argv",
    [[], ["-q", "-N"], ["-q", "-t", "0"], ["-q", "-t", "soon"], ["-i", "10.0.0.1"], ["-z"]],
)
def test_wrong_command_lines_are_usage_errors(argv: list[str]) -> None:
    """No mode, two modes, a bad timeout, a missing value or an unknown flag."""
    with pytest.raises(UsageError):
        parse_args(argv)


def test_help_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """`-h` prints the real usage line on stdout and succeeds."""
    assert main(["-h"]) == 0
    assert capsys.readouterr().out.startswith("Usage: nvidia-imex-ctl [-i <IP> <PORT>|")


def test_unmodelled_modes_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`-s`, `-d` and `-m` exist in the real tool; the simulator says it lacks them."""
    assert main(["-i", "127.0.0.1", "1", "-s"]) == 1
    assert "not modelled" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ("IMEX_CMD_BIND_INTERFACE_IP=10.0.0.7\nIMEX_CMD_PORT=6000\n", CmdTarget("10.0.0.7", 6000)),
        ("BIND_INTERFACE_IP=10.0.0.8\n", CmdTarget("10.0.0.8", 50005)),
        ("", CmdTarget("127.0.0.1", 50005)),
        ("IMEX_CMD_UNIX_DOMAIN_PATH=/run/x.sock\n", CmdTarget(path="/run/x.sock")),
    ],
)
def test_the_command_service_is_found_from_config(
    tmp_path: Path, lines: str, expected: CmdTarget
) -> None:
    """The command bind address, else the bind address, else localhost; or the socket."""
    cfg = tmp_path / "config.cfg"
    cfg.write_text(lines)
    assert target_from_config(str(cfg)) == expected


def test_a_disabled_command_service_is_unavailable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """IMEX_CMD_ENABLED=0: nothing to ask; `-q` says UNAVAILABLE and why, exit 1."""
    cfg = tmp_path / "config.cfg"
    cfg.write_text("IMEX_CMD_ENABLED=0\n")
    with pytest.raises(CommandError, match="IMEX_CMD_ENABLED=0"):
        target_from_config(str(cfg))
    assert main(["-c", str(cfg), "-q"]) == 1
    out = capsys.readouterr()
    assert out.out == "UNAVAILABLE\n"
    assert "IMEX_CMD_ENABLED=0" in out.err


HEAVY = (
    "asyncio",
    "msgspec",
    "dataclasses",
    "typing",
    "imexd.sim.protocol",
    "imexd.sim.table",
    "socket",
    "selectors",
    "ipaddress",
)
"""What `-q` must not import: `socket` (its enums and selectors) and `ipaddress` cost more
than the round trip itself; the C module `_socket` and a check of IPv4 literals do."""


def query_imports(cfg: Path, *python: str, site_dir: Path | None = None) -> tuple[str, str]:
    """Run `-q` in a new interpreter (`python` its command line up to `-c`): its answer,
    and the HEAVY modules it imported beyond those the interpreter had loaded at start
    (what site and the install's .pth files load every process pays, not `-q`)."""
    probe = (
        "import sys\n"
        + ("" if site_dir is None else f"import site; site.addsitedir({str(site_dir)!r})\n")
        + "started = set(sys.modules)\n"
        "from imexd.sim.ctl import main\n"
        f"code = main(['-c', {str(cfg)!r}, '-q', '-t', '200'])\n"
        f"added = [m for m in {HEAVY!r} if m in sys.modules and m not in started]\n"
        "print('\\n' + str(code) + ' ' + ','.join(added) + ' ' + sys.modules['imexd'].__file__)"
    )
    done = subprocess.run(
        [*python, "-c", probe],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd=cfg.parent,  # `-c` puts the folder it runs in first on sys.path
    )
    lines = done.stdout.splitlines()
    return lines[0], lines[-1]


def test_query_imports_only_the_socket_layer(tmp_path: Path) -> None:
    """`-q` (the agent's probe, at every start and every probe interval) is a blocking
    socket round trip that reads config.cfg as the agent wrote it: no event loop, no
    msgspec, no dataclasses, not even typing or the socket module, so that it costs about
    what a small C program costs. A module-level import added to its path fails here."""
    cfg = tmp_path / "config.cfg"
    cfg.write_text("IMEX_CMD_BIND_INTERFACE_IP=127.0.0.1\nIMEX_CMD_PORT=1\nLOG_LEVEL=4\n")
    answer, imported = query_imports(cfg, sys.executable)
    assert answer == "UNAVAILABLE"
    assert imported.split(" ")[:2] == ["1", ""], imported


def test_query_imports_only_the_socket_layer_under_the_readmes_install(tmp_path: Path) -> None:
    """The same holds under the install the README's first command makes (setuptools'
    default editable mode, whose import hook loads pathlib and ipaddress in every process
    before `-q` runs): a copy of the package installed that way, offline, imports nothing
    heavy of its own."""
    source = tmp_path / "src"
    source.mkdir()
    shutil.copytree(ROOT / "imexd", source / "imexd", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    prefix = tmp_path / "prefix"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    offline = ["--no-deps", "--no-build-isolation", "--no-index", "--ignore-installed"]
    offline += ["--prefix", str(prefix)]  # beside, not instead of, the suite's own install
    subprocess.run([*pip, *offline, "-e", str(source)], check=True, timeout=120)
    (site_dir,) = prefix.glob("lib/python*/site-packages")
    assert list(site_dir.glob("__editable__*finder.py")), "not setuptools' default mode"
    cfg = tmp_path / "config.cfg"
    cfg.write_text("IMEX_CMD_BIND_INTERFACE_IP=127.0.0.1\nIMEX_CMD_PORT=1\nLOG_LEVEL=4\n")
    answer, imported = query_imports(cfg, sys.executable, "-S", site_dir=site_dir)
    assert answer == "UNAVAILABLE"
    code, heavy, origin = imported.split(" ")
    assert Path(origin).is_relative_to(source), "the probe ran another install of imexd"
    assert (code, heavy) == ("1", ""), imported


def test_the_query_frames_are_the_protocols() -> None:
    """`-q` compares its request and the daemon's replies as bytes: they are exactly what
    the protocol's encoder writes, for every state word."""
    assert encode(QueryRequest()) == QUERY_FRAME
    assert {encode(QueryReply(state=state)): state for state in NodeState} == QUERY_REPLIES


def status_reply(nodes: list[str], *, node: int = 0, cmd_port: int = 50005) -> StatusReply:
    """A READY node's status reply, every link CONNECTED."""
    return StatusReply(
        node=node,
        state=NodeState.READY,
        version="570.172",
        instance="i",
        pid=7,
        digest="d",
        server_port=50000,
        cmd_port=cmd_port,
        nodes=nodes,
        links=[Link(status=LinkStatus.CONNECTED, changed=True)] * len(nodes),
    )


def _answer_once(reply: bytes) -> tuple[socket.socket, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(reply)

    thread = threading.Thread(target=serve)
    thread.start()
    return server, thread


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (b'{"state": "READY", "type": "query"}\n', NodeState.READY),
        (b'{"type":"query","state":"SOON"}\n', "answered something unreadable"),
        (b"READY\n", "answered something unreadable"),
        (
            encode(status_reply(["n0"])),
            "answered a query with StatusReply",
        ),
    ],
)
def test_any_other_query_reply_goes_to_the_strict_decoder(
    reply: bytes, expected: NodeState | str
) -> None:
    """A reply that is not the daemon's own bytes for a state is decoded strictly: the
    same reply in another key order is still understood; a wrong word, a bare word or a
    reply of another kind is an error that says so."""
    server, thread = _answer_once(reply)
    target = CmdTarget("127.0.0.1", server.getsockname()[1])
    try:
        if isinstance(expected, NodeState):
            assert query(target, timeout_s=5.0) is expected
        else:
            with pytest.raises(CommandError, match=expected):
                query(target, timeout_s=5.0)
    finally:
        thread.join(timeout=5)
        server.close()


HEAVY_FOR_DOMAIN = ("asyncio", "msgspec", "dataclasses", "typing", "imexd.sim.protocol")
"""What `-N` must not import: msgspec alone (with the dataclasses and typing it imports)
cost `-N` about three times what the rest of it costs."""


def test_domain_view_imports_no_event_loop_and_no_decoder_library() -> None:
    """`-N -j` (the agent's domain probe, after every start and link news) asks the local
    daemon and its peers over blocking sockets and reads their replies with the standard
    json module: a daemon answering a two-node status prints the real `-N -j` document,
    and none of HEAVY_FOR_DOMAIN is imported on the way."""
    local = status_reply(["127.0.0.1", "127.0.0.2"], cmd_port=1)
    server, thread = _answer_once(encode(local))
    port = server.getsockname()[1]
    probe = (
        "import sys\n"
        "from imexd.sim.ctl import main\n"
        f"code = main(['-i', '127.0.0.1', '{port}', '-N', '-j', '-t', '2000'])\n"
        "print('\\n' + str(code) + ' ' + ','.join(m for m in "
        f"{HEAVY_FOR_DOMAIN!r} if m in sys.modules))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
        )
    finally:
        thread.join(timeout=5)
        server.close()
    lines = done.stdout.splitlines()
    assert lines[-1].split(" ") == ["0", ""], done.stdout + done.stderr
    document = json.loads(lines[0])
    assert document["nodes"]["0"]["status"] == "READY"
    assert document["nodes"]["1"]["status"] == "UNAVAILABLE"  # the sentinel is never asked
    assert document["status"] == "DEGRADED"


def test_every_peer_is_asked_at_once_within_one_deadline() -> None:
    """One peer answers, two accept and stay silent, one refuses: the answer, two timeouts
    and a refusal come back together, after one deadline (2 s), not one per silent peer."""
    answering = socket.create_server(("127.0.0.1", 0))
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    closed = socket.create_server(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()
    held: list[socket.socket] = []

    def serve() -> None:
        conn, _ = answering.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(encode(QueryReply(state=NodeState.READY)))

    def hold(server: socket.socket) -> None:
        conn, _ = server.accept()
        held.append(conn)  # never answered, closed at the end

    threads = [threading.Thread(target=serve)]
    threads += [threading.Thread(target=hold, args=(server,)) for server in silent]
    for thread in threads:
        thread.start()
    targets = [
        CmdTarget("127.0.0.1", answering.getsockname()[1]),
        *(CmdTarget("127.0.0.1", server.getsockname()[1]) for server in silent),
        CmdTarget("127.0.0.1", refused_port),
    ]
    try:
        started = time.monotonic()
        got = exchange_all(targets, QUERY_FRAME, timeout_s=2.0)
        took = time.monotonic() - started
    finally:
        for thread in threads:
            thread.join(timeout=5)
        for sock in (answering, *silent, *held):
            sock.close()
    assert got[0] == encode(QueryReply(state=NodeState.READY))
    assert all(isinstance(g, CommandError) and "no answer" in str(g) for g in got[1:3]), got
    assert isinstance(got[3], CommandError)
    assert "Connection refused" in str(got[3])
    assert took < 3.5, f"{took:.1f} s: one deadline for every peer, not one each (4 s)"


def _status_lines() -> list[bytes]:
    """A valid status reply, and every way of breaking it that `-N` could meet: each
    field missing or of another JSON type, a word that is not a state, a link that is
    not one, another kind of reply, not JSON, not UTF-8, and an extra field."""
    good = json.loads(encode(status_reply(["gpu-a", "127.0.0.2"], node=1)))
    documents: list[object] = [good, {**good, "extra": [1]}, [good], None, "status"]
    others: list[object] = [None, True, 1, 1.0, "1", [], {}]
    for name in good:
        documents.append({k: v for k, v in good.items() if k != name})
        documents += [{**good, name: other} for other in others]
    documents += [
        {**good, "state": "SOON"},
        {**good, "nodes": ["gpu-a", 2]},
        {**good, "links": [{"status": "CONNECTED", "changed": 1}]},
        {**good, "links": [{"status": "UP", "changed": True}]},
        {**good, "links": [{"changed": True}]},
        {**good, "links": ["C"]},
        {**good, "links": [{"status": "CONNECTED", "changed": True, "since": 3}]},
    ]
    lines = [json.dumps(d).encode() + b"\n" for d in documents]
    return [*lines, b"{", b'{"type":"status"', b"\xff\xfe\n", b"\n"]


@pytest.mark.parametrize("line", _status_lines())
def test_status_replies_are_read_as_strictly_as_the_protocol_reads_them(line: bytes) -> None:
    """`-N` reads status replies without msgspec (`decode_status`): for every reply it
    accepts exactly what the protocol's strict decoder accepts as a StatusReply, and
    reads the same values from it."""
    target = CmdTarget("127.0.0.1", 1)
    try:
        strict: object = decode_reply(target, line)
    except CommandError as exc:
        strict = exc
    try:
        lean: object = decode_status(target, line)
    except CommandError as exc:
        lean = exc
    if not isinstance(strict, StatusReply):
        assert isinstance(lean, CommandError), (line, strict)
        assert "answered something unreadable" in str(lean)
        return
    assert isinstance(lean, NodeStatus), (line, lean)
    assert (lean.node, lean.state, lean.version, lean.cmd_port, lean.nodes) == (
        strict.node,
        strict.state,
        strict.version,
        strict.cmd_port,
        strict.nodes,
    )
    assert [(c.status, c.changed) for c in lean.links] == [
        (link.status, link.changed) for link in strict.links
    ]


@pytest.mark.parametrize(
    "reply",
    [status_reply(["127.0.0.2"], node=5), status_reply(["127.0.0.1", "127.0.0.3"], cmd_port=70000)],
    ids=["node id beyond the list", "command port beyond 65535"],
)
def test_odd_but_well_formed_status_replies_are_shown_not_a_crash(
    reply: StatusReply, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replies the protocol's decoder takes but that name no row of their own (a node id
    beyond the node list) or a port no peer can have: `-N` prints the rows it can, the
    rest UNAVAILABLE, and exits 0, instead of a KeyError or an OverflowError."""
    server, thread = _answer_once(encode(reply))
    try:
        code = main(["-i", "127.0.0.1", str(server.getsockname()[1]), "-N", "-j", "-t", "2000"])
    finally:
        thread.join(timeout=5)
        server.close()
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert document["nodes"][str(len(reply.nodes) - 1)]["status"] == "UNAVAILABLE"
