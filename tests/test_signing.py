"""Control-plane signatures: the exact wire format, `imexd keys create`, the `[control]`
settings, and the agent's check at the bus boundary (pure: no broker)."""

from __future__ import annotations

import base64
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from imexd.bus.signatures import Signatures
from imexd.cli.query import print_report
from imexd.errors import ConfigError
from imexd.facts import BusFacts, Facts
from imexd.health.conditions import conditions, report
from imexd.messages import (
    Assignment,
    Deleted,
    DomainSpec,
    Dropped,
    DropReason,
    MemberRecord,
    MemberState,
    Received,
    Retry,
    WorkloadRecord,
    decode_message,
    encode,
)
from imexd.settings import settings_from_mapping
from imexd.signing import (
    SIG_CHARS,
    KeysError,
    Signer,
    Verifier,
    attach,
    create_keys,
    detach,
    key_problems,
    load_signer,
    load_verifier,
    signed_bytes,
)
from imexd.topics import Topics
from tests.support import imexd

SPEC_TOPIC = "imex/v2/domains/d1/spec"
SPEC = encode(DomainSpec(domain="d1", nodes=["n1", "n2"], max_nodes=8, generation=2))


def signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A key pair made by `create_keys` (control.key, control.pub)."""
    private, public, _ = create_keys(tmp_path_factory.mktemp("keys") / "control")
    return private, public


# The wire format.


def test_a_sealed_record_is_the_record_with_a_trailing_sig_member() -> None:
    """Sealing replaces the closing brace by `,"sig":"<86 base64url characters>"}`: the
    rest of the bytes are the record's as encoded, and it still decodes as the record."""
    s = signer()
    sealed = s.seal(SPEC_TOPIC, SPEC)
    assert sealed.startswith(SPEC[:-1] + b',"sig":"')
    assert sealed.endswith(b'"}')
    text = json.loads(sealed)["sig"]
    assert len(text) == SIG_CHARS
    assert "=" not in text
    assert json.loads(sealed) == {**json.loads(SPEC), "sig": text}
    raw = base64.urlsafe_b64decode(text + "==")
    s.key.public_key().verify(raw, SPEC_TOPIC.encode() + b"\n" + SPEC)


@pytest.mark.parametrize(
    ("topic", "record"),
    [
        (SPEC_TOPIC, DomainSpec(domain="d1")),
        ("imex/v2/domains/d1/workloads/w1", WorkloadRecord(workload="w1", domain="d1", channel=3)),
        ("imex/v2/nodes/n1/assignment", Assignment(domain=None)),
        ("imex/v2/domains/d1/retry/n1", Retry(node="n1", domain="d1", at=1.5)),
    ],
)
def test_a_sealed_record_of_each_kind_verifies(
    topic: str, record: DomainSpec | WorkloadRecord | Assignment | Retry
) -> None:
    """Round trip: what the signer seals on a topic verifies with its public key there."""
    s = signer()
    assert s.verifier().problem(topic, s.seal(topic, encode(record))) is None


def test_a_flipped_byte_fails() -> None:
    """Any byte changed in the record (or its signature) makes it fail with `signature`."""
    s = signer()
    sealed = s.seal(SPEC_TOPIC, SPEC)
    for index in (1, len(SPEC) // 2, len(sealed) - 5):
        changed = bytearray(sealed)
        changed[index] ^= 0x01
        problem = s.verifier().problem(SPEC_TOPIC, bytes(changed))
        assert problem is not None, index
        assert problem[0] in ("signature", "unsigned"), index
    edited = sealed.replace(b'"generation":2', b'"generation":3')
    assert s.verifier().problem(SPEC_TOPIC, edited) == (
        "signature",
        "the signature does not verify with control.public_key (another key, another topic, "
        "or changed bytes)",
    )


def test_another_key_fails() -> None:
    """A record signed with another private key fails with `signature`."""
    sealed = signer().seal(SPEC_TOPIC, SPEC)
    problem = signer().verifier().problem(SPEC_TOPIC, sealed)
    assert problem is not None
    assert problem[0] == "signature"


def test_another_topic_fails() -> None:
    """The topic is signed: a signed record copied onto another topic fails."""
    s = signer()
    sealed = s.seal(SPEC_TOPIC, SPEC)
    problem = s.verifier().problem("imex/v2/domains/d2/spec", sealed)
    assert problem is not None
    assert problem[0] == "signature"


def test_a_record_without_sig_is_unsigned() -> None:
    """The record as encoded, without a signature, is `unsigned`."""
    problem = signer().verifier().problem(SPEC_TOPIC, SPEC)
    assert problem is not None
    assert problem[0] == "unsigned"


def test_a_sig_not_at_the_end_is_unsigned() -> None:
    """A valid `sig` member moved before another member, or spaced out, is not the trailing
    member the format fixes: `unsigned`."""
    s = signer()
    sealed = s.seal(SPEC_TOPIC, SPEC)
    sig = json.loads(sealed)["sig"]
    moved = b'{"sig":"' + sig.encode() + b'",' + SPEC[1:]
    spaced = sealed.replace(b',"sig":"', b', "sig": "')
    for data in (moved, spaced, sealed + b" ", sealed[:-2] + b'","x":1}'):
        problem = s.verifier().problem(SPEC_TOPIC, data)
        assert problem is not None, data
        assert problem[0] == "unsigned", data


def test_a_sig_of_the_wrong_text_fails() -> None:
    """A trailing `sig` of 86 characters that is not canonical base64url of the signature
    (stray bits in its last character) fails with `signature`."""
    s = signer()
    sealed = s.seal(SPEC_TOPIC, SPEC)
    last = sealed[-3:-2]
    stray = {b"A": b"B", b"Q": b"R", b"g": b"h", b"w": b"x"}[last]
    data = sealed[:-3] + stray + sealed[-2:]
    found = detach(data)
    assert found is not None
    assert found[1] is None
    problem = s.verifier().problem(SPEC_TOPIC, data)
    assert problem is not None
    assert problem[0] == "signature"


def test_only_an_object_with_a_member_can_be_signed() -> None:
    """`attach` refuses what has no closing brace to replace, or no member before it."""
    for body in (b"{}", b"{ }", b"[1]", b"1"):
        with pytest.raises(ValueError, match="JSON object"):
            attach(body, bytes(64))


@given(
    st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), min_size=1),
    st.text(min_size=1, max_size=40),
)
def test_detach_undoes_attach(record: dict[str, object], topic: str) -> None:
    """For any JSON object, detaching the attached signature gives back B and the
    signature's bytes, and M is the topic's UTF-8, a newline and B."""
    body = json.dumps(record, separators=(",", ":")).encode()
    signature = bytes(range(64))
    assert detach(attach(body, signature)) == (body, signature)
    assert signed_bytes(topic, body) == topic.encode() + b"\n" + body


# Keys: `imexd keys create` and loading them.


def test_create_keys_writes_a_pair_with_their_modes(keys: tuple[Path, Path]) -> None:
    """control.key is a PKCS8 PEM private key of mode 0600, control.pub its
    SubjectPublicKeyInfo PEM public key; they load, and seal and verify together."""
    private, public = keys
    assert private.name == "control.key"
    assert public.name == "control.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----\n")
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----\n")
    serialization.load_pem_private_key(private.read_bytes(), password=None)
    s, v = load_signer(str(private)), load_verifier(str(public))
    assert v.fingerprint == s.verifier().fingerprint
    assert v.fingerprint.startswith("ed25519:")
    assert v.problem(SPEC_TOPIC, s.seal(SPEC_TOPIC, SPEC)) is None
    assert key_problems(str(private), str(public)) == []


def test_create_keys_never_overwrites(tmp_path: Path) -> None:
    """An existing control.key or control.pub is refused, naming it, and nothing is
    written (the other file is not made either)."""
    (tmp_path / "control.pub").write_text("mine")
    with pytest.raises(KeysError, match=r"control\.pub already exist"):
        create_keys(tmp_path)
    assert not (tmp_path / "control.key").exists()
    assert (tmp_path / "control.pub").read_text() == "mine"


def test_create_keys_refuses_a_bad_folder(tmp_path: Path) -> None:
    """A file where the folder should be, or one below a file, is refused with why."""
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(KeysError, match="not a directory"):
        create_keys(plain)
    with pytest.raises(KeysError, match="cannot create it"):
        create_keys(plain / "below")


def test_keys_create_on_the_command_line(tmp_path: Path) -> None:
    """`imexd keys create DIR` prints both paths and the fingerprint (exit 0); again on
    the same DIR it exits 2 naming the existing files; a DIR that is a file exits 2."""
    made = imexd("keys", "create", str(tmp_path / "k"))
    assert made.returncode == 0, made.stderr
    assert str(tmp_path / "k" / "control.key") in made.stdout
    assert str(tmp_path / "k" / "control.pub") in made.stdout
    fingerprint = load_verifier(str(tmp_path / "k" / "control.pub")).fingerprint
    assert fingerprint in made.stdout
    again = imexd("keys", "create", str(tmp_path / "k"))
    assert again.returncode == 2
    assert "already exist: not overwritten" in again.stderr
    assert "Traceback" not in again.stderr
    (tmp_path / "f").write_text("x")
    bad = imexd("keys", "create", str(tmp_path / "f"))
    assert bad.returncode == 2
    assert "not a directory" in bad.stderr


def test_a_key_file_that_is_no_key_is_one_problem_naming_it(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """A missing file, a file that is not a PEM key, a key of the wrong kind, or a
    private key given as the public one: one line naming the key and the path."""
    private, public = keys
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key\n")
    (tmp_path / "other").mkdir()
    other, other_pub, _ = create_keys(tmp_path / "other")
    assert key_problems(str(tmp_path / "none"), "") == [
        f"control.private_key = '{tmp_path / 'none'}': cannot read it: No such file or directory"
    ]
    [line] = key_problems("", str(junk))
    assert line.startswith(f"control.public_key = '{junk}': expected a SubjectPublicKeyInfo")
    [line] = key_problems(str(public), "")
    assert line.startswith(f"control.private_key = '{public}': expected an unencrypted PKCS8")
    [line] = key_problems(str(private), str(other_pub))
    assert line.startswith(f"control.public_key = '{other_pub}': expected the public key of")
    assert key_problems(str(other), str(other_pub)) == []
    with pytest.raises(ConfigError, match=r"control\.private_key"):
        load_signer(str(junk))


def test_an_rsa_key_is_refused(tmp_path: Path) -> None:
    """A PEM key of another algorithm is refused: only Ed25519 signs records."""
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "ec.pub"
    path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    [line] = key_problems("", str(path))
    assert line == f"control.public_key = '{path}': expected an Ed25519 key, found another kind"


# Settings.


def test_control_settings_default_empty_and_load_from_file_and_environment() -> None:
    """[control] private_key and public_key are empty by default (records unsigned) and
    set from the file or IMEXD_CONTROL_*, the environment winning."""
    base = {"node": {"name": "n1", "address": "127.0.0.1"}}
    s = settings_from_mapping(base, environ={})
    assert (s.control.private_key, s.control.public_key) == ("", "")
    s = settings_from_mapping(
        {**base, "control": {"private_key": "/a/control.key", "public_key": "/a/control.pub"}},
        environ={"IMEXD_CONTROL_PUBLIC_KEY": "/b/control.pub"},
    )
    assert (s.control.private_key, s.control.public_key) == ("/a/control.key", "/b/control.pub")
    with pytest.raises(ConfigError, match=r"control\.public_key = ' /x': expected a file path"):
        settings_from_mapping({**base, "control": {"public_key": " /x"}}, environ={})


def test_a_bad_key_file_stops_run_config_and_the_control_plane(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """`imexd config`, `imexd run` and a control-plane command exit 2 on a key file that
    cannot be loaded, naming the key, before anything starts."""
    junk = tmp_path / "junk.pem"
    junk.write_text("junk")
    config = tmp_path / "imexd.toml"
    config.write_text(
        '[node]\nname = "n1"\naddress = "127.0.0.1"\nclique = ""\n'
        f'state_dir = "{tmp_path / "state"}"\n[bus]\nurl = "mqtt://127.0.0.1:9"\n'
        f'[control]\npublic_key = "{junk}"\n'
    )
    for args in (["config"], ["run"], ["domain", "list"]):
        proc = imexd(*args, "--config", str(config))
        assert proc.returncode == 2, (args, proc.stderr)
        assert f"control.public_key = '{junk}': expected a SubjectPublicKeyInfo" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_no_key_loads_no_cryptography() -> None:
    """Without a key, loading the agent's code and settings and running a control
    command never imports `cryptography` (an agent's idle memory)."""
    probe = (
        "import sys, contextlib\n"
        "import imexd.agent.run, imexd.bus.link, imexd.control.commands, imexd.preflight\n"
        "from imexd.settings import load_settings\n"
        "s = load_settings(None, environ={'IMEXD_NODE_NAME': 'n1', "
        "'IMEXD_NODE_ADDRESS': '127.0.0.1'})\n"
        "imexd.preflight.check(s, programs=False)\n"
        "from imexd.cli.main import main\n"
        "with contextlib.suppress(SystemExit):\n"
        "    main(['workload', 'list'])\n"
        "print('cryptography' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
    env["IMEXD_BUS_URL"] = "mqtt://127.0.0.1:9"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    assert done.stdout.splitlines()[-1] == "False", done.stdout + done.stderr


def test_verifier_is_the_one_of_its_key(keys: tuple[Path, Path]) -> None:
    """A Verifier built from the loaded public key has the fingerprint of the file."""
    _, public = keys
    v = load_verifier(str(public))
    assert isinstance(v, Verifier)
    assert v.fingerprint == load_verifier(str(public)).fingerprint


# The agent's check at the bus boundary (imexd.bus.signatures).

T = Topics("imex/v2")


def _message(topic: str, data: bytes) -> Received | Deleted:
    result = decode_message(T, topic, data, retained=False)
    assert not isinstance(result, Dropped), result
    return result


def test_the_boundary_delivers_only_what_the_control_key_signed() -> None:
    """A signed record passes as it came; an unsigned one and one signed with another key
    are dropped by reason and stand (BusConnected), until a signed record replaces them."""
    s = signer()
    check = Signatures(s.verifier())
    topic = T.spec("d1")
    sealed = s.seal(topic, SPEC)
    passed = check.check(_message(topic, sealed))
    assert isinstance(passed, Received)
    assert passed.data == sealed
    dropped = check.check(_message(topic, SPEC))
    assert isinstance(dropped, Dropped)
    assert dropped.reason is DropReason.UNSIGNED
    assert check.standing == {topic: "unsigned"}
    foreign = check.check(_message(topic, signer().seal(topic, SPEC)))
    assert isinstance(foreign, Dropped)
    assert foreign.reason is DropReason.SIGNATURE
    assert check.standing == {topic: "signature"}
    assert isinstance(check.check(_message(topic, sealed)), Received)
    assert check.standing == {}


def test_the_boundary_leaves_other_kinds_alone() -> None:
    """Member records, health reports and presence are the nodes' own: never checked."""
    check = Signatures(signer().verifier())
    record = MemberRecord(
        node="n1",
        domain="d1",
        clique="c1",
        address="127.0.0.9",
        slot=0,
        incarnation=1,
        state=MemberState.MEMBER,
        max_nodes=8,
        mode="names",
    )
    topic = T.member("d1", "c1", "n1")
    assert isinstance(check.check(_message(topic, encode(record))), Received)
    assert isinstance(check.check(_message(topic, b"")), Deleted)
    assert check.standing == {}


@pytest.mark.parametrize(
    ("topic", "live"),
    [
        (T.spec("d1"), DomainSpec(domain="d1")),
        (T.assignment("n1"), Assignment(domain="d1")),
        (T.workload("d1", "w1"), WorkloadRecord(workload="w1", domain="d1", channel=3)),
    ],
)
def test_a_clear_of_a_signed_record_passes_to_the_order(
    topic: str, live: DomainSpec | Assignment | WorkloadRecord
) -> None:
    """A clear cannot be signed and is not judged here: it reaches the agent's order,
    which answers it with the record it holds (no clear removes one), and it ends what
    stood unverified on its topic."""
    s = signer()
    check = Signatures(s.verifier())
    assert isinstance(check.check(_message(topic, encode(live))), Dropped)
    assert check.standing == {topic: "unsigned"}
    assert isinstance(check.check(_message(topic, s.seal(topic, encode(live)))), Received)
    assert isinstance(check.check(_message(topic, b"")), Deleted)
    assert check.standing == {}


def test_a_retry_clear_and_a_clear_of_nothing_pass() -> None:
    """A clear of a retry request and a clear of a topic that held no verified record
    reach the caller; a new link forgets records that do not verify (its snapshot says
    again)."""
    s = signer()
    check = Signatures(s.verifier())
    retry = T.retry("d1", "n1")
    request = encode(Retry(node="n1", domain="d1", at=2.0))
    assert isinstance(check.check(_message(retry, s.seal(retry, request))), Received)
    assert isinstance(check.check(_message(retry, b"")), Deleted)
    assert isinstance(check.check(_message(T.spec("d9"), b"")), Deleted)
    assert isinstance(check.check(_message(T.spec("d2"), encode(DomainSpec(domain="d2")))), Dropped)
    check.link_up()
    assert check.standing == {}
    check.forget(lambda topic: False)
    assert check.standing == {}


# What the node says: BusConnected, the HealthReport, `imexd status`.


def test_unverified_records_keep_the_node_ready_and_are_named() -> None:
    """Records that do not verify make BusConnected say UnverifiedRecords (still True: a
    forger must not make nodes unready), naming three topics and why, and counting more."""
    standing = (
        ("imex/v2/domains/d1/spec", "signature"),
        ("imex/v2/domains/d1/workloads/w1", "signature"),
        ("imex/v2/domains/d1/workloads/w2", "unsigned"),
        ("imex/v2/nodes/n1/assignment", "unsigned"),
    )
    bus = BusFacts(connected=True, synced=True, broker="mqtt://b:1883", unverified=standing)
    [cond] = [c for c in conditions(Facts(node="n1", bus=bus), (), 1.0) if c.type == "BusConnected"]
    assert (cond.status, cond.reason) == ("True", "UnverifiedRecords")
    assert cond.message.startswith("connected to mqtt://b:1883; ignoring 4 control-plane record")
    assert "imex/v2/domains/d1/spec (signed with another key)" in cond.message
    assert "imex/v2/domains/d1/workloads/w1 (signed with another key)" in cond.message
    assert "and 1 more" in cond.message
    calm = BusFacts(connected=True, synced=True, broker="mqtt://b:1883")
    [cond] = [
        c for c in conditions(Facts(node="n1", bus=calm), (), 1.0) if c.type == "BusConnected"
    ]
    assert cond.reason == "Connected"


def test_status_says_whether_records_are_verified() -> None:
    """The HealthReport carries the key's fingerprint ("" without one), and `imexd status`
    says "records verified with key ..." or "records accepted unsigned"."""
    for key, line in (
        (
            "ed25519:0123456789abcdef",
            "control   records verified with key ed25519:0123456789abcdef",
        ),
        ("", "control   records accepted unsigned (no control.public_key)"),
    ):
        facts = Facts(node="n1", bus=BusFacts(connected=True, synced=True, control_key=key))
        rep = report(facts, conditions(facts, (), 1.0), 1.0)
        assert rep.control_key == key
        out = io.StringIO()
        print_report(rep, out)
        assert line in out.getvalue().splitlines()
