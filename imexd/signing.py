"""The control plane's signatures: Ed25519 over the exact bytes of a record and its topic.

The control plane signs what it writes for agents to follow (specs, workloads,
assignments, retry requests) with `[control] private_key`; agents with
`[control] public_key` act only on records that verify (`imexd.bus.signatures`). The
format is exact on the bytes, so that another language can write it and so that a copy
an agent restores verbatim verifies as it came:

- B: the record's JSON object without a signature (`{...}`, as the writer encoded it);
- M = topic (UTF-8) + b"\\n" + B, signed with Ed25519: binding the topic means a signed
  record cannot be replayed onto another topic;
- on the wire: B with its closing `}` replaced by `,"sig":"<S>"}`, S being the 64-byte
  signature in base64url without padding (86 characters).

A verifier strips exactly that trailing member to get B back. Decoders ignore unknown
fields, so `sig` needs no field in the payload types.

`cryptography` is imported only where a key is loaded or made: an agent without
`[control] public_key` never loads it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

import msgspec

from imexd.errors import ConfigError, ImexdError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

SIGNED_KINDS: Final = frozenset({"spec", "workload", "assignment", "retry"})
"""The topic kinds (`imexd.topics.TopicRef.kind`) whose records the control plane signs."""
SIG_OPEN: Final = b',"sig":"'
SIG_CLOSE: Final = b'"}'
SIG_CHARS: Final = 86
"""Base64url characters of a 64-byte signature without padding."""
SIG_TAIL: Final = len(SIG_OPEN) + SIG_CHARS + len(SIG_CLOSE)
_SIG_TEXT: Final = re.compile(rb"[A-Za-z0-9_-]{86}")

PRIVATE_KEY_FILE: Final = "control.key"
PUBLIC_KEY_FILE: Final = "control.pub"
PRIVATE_KEY_MODE: Final = 0o600
PUBLIC_KEY_MODE: Final = 0o644

Problem = Literal["unsigned", "signature"]
"""Why a record does not verify: it carries no trailing `sig` member, or one that does
not verify with the key (another key, another topic, changed bytes)."""


class KeysError(ImexdError):
    """`imexd keys create` cannot make the key pair here (the message says why)."""


def signed_bytes(topic: str, body: bytes) -> bytes:
    """M, what the signature covers: the topic, a newline, the record without `sig`."""
    return topic.encode("utf-8") + b"\n" + body


def attach(body: bytes, signature: bytes) -> bytes:
    """The record `body` (a JSON object with at least one member) as published with its
    64-byte `signature`: its closing brace replaced by the `sig` member."""
    if len(signature) != 64:
        raise ValueError(f"an Ed25519 signature has 64 bytes, not {len(signature)}")
    if not body.startswith(b"{") or not body.endswith(b"}") or not body[1:-1].strip():
        raise ValueError("only a JSON object with at least one member can be signed")
    text = base64.urlsafe_b64encode(signature).rstrip(b"=")
    return body[:-1] + SIG_OPEN + text + SIG_CLOSE


def detach(data: bytes) -> tuple[bytes, bytes | None] | None:
    """(B, the signature) of a published record; the signature is None when the trailing
    member is a `sig` that is not canonical base64url of 64 bytes. None when `data` does
    not end with a `sig` member exactly as `attach` writes it."""
    if len(data) <= SIG_TAIL or not data.endswith(SIG_CLOSE):
        return None
    tail = data[-SIG_TAIL:]
    if not tail.startswith(SIG_OPEN):
        return None
    text = tail[len(SIG_OPEN) : len(SIG_OPEN) + SIG_CHARS]
    if _SIG_TEXT.fullmatch(text) is None:
        return None
    body = data[:-SIG_TAIL] + b"}"
    signature = base64.urlsafe_b64decode(text + b"==")
    if base64.urlsafe_b64encode(signature).rstrip(b"=") != text:
        return body, None  # stray bits in the last character: not the signer's text
    return body, signature


def fingerprint(public_raw: bytes) -> str:
    """`ed25519:` and the first 16 hex digits of the SHA-256 of the raw 32-byte public
    key: what `imexd keys create` prints and `/status` shows, to compare keys by eye."""
    return "ed25519:" + hashlib.sha256(public_raw).hexdigest()[:16]


class Signer(msgspec.Struct, frozen=True):
    """The control plane's private key: seals the records it writes."""

    key: Ed25519PrivateKey

    def seal(self, topic: str, body: bytes) -> bytes:
        """`body` (a record without `sig`) as published on `topic`, signed."""
        return attach(body, self.key.sign(signed_bytes(topic, body)))

    def verifier(self) -> Verifier:
        """The matching public key's verifier."""
        return Verifier(self.key.public_key())


class Verifier(msgspec.Struct, frozen=True):
    """The control plane's public key: tells a record it signed from any other."""

    key: Ed25519PublicKey

    @property
    def fingerprint(self) -> str:
        from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 - lazy

        return fingerprint(
            self.key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        )

    def problem(self, topic: str, data: bytes) -> tuple[Problem, str] | None:
        """None when `data`, published on `topic`, carries a signature of the control
        key over it; else why not, and a sentence for the log."""
        from cryptography.exceptions import InvalidSignature  # noqa: PLC0415 - lazy

        found = detach(data)
        if found is None:
            return "unsigned", "no signature: the record does not end with a sig member"
        body, signature = found
        if signature is not None:
            try:
                self.key.verify(signature, signed_bytes(topic, body))
            except InvalidSignature:
                pass
            else:
                return None
        return (
            "signature",
            "the signature does not verify with control.public_key (another key, another "
            "topic, or changed bytes)",
        )


def load_signer(path: str, *, key: str = "control.private_key") -> Signer:
    """The private key in `path` (PKCS8 PEM, unencrypted); ConfigError naming `key`."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 - lazy
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415 - lazy
        Ed25519PrivateKey,
    )

    data = _read(path, key)
    try:
        loaded = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError([_bad(key, path, "an unencrypted PKCS8 PEM private key", exc)]) from None
    if not isinstance(loaded, Ed25519PrivateKey):
        raise ConfigError([f"{key} = {path!r}: expected an Ed25519 key, found another kind"])
    return Signer(loaded)


def load_verifier(path: str, *, key: str = "control.public_key") -> Verifier:
    """The public key in `path` (SubjectPublicKeyInfo PEM); ConfigError naming `key`."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 - lazy
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415 - lazy
        Ed25519PublicKey,
    )

    data = _read(path, key)
    try:
        loaded = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ConfigError([_bad(key, path, "a SubjectPublicKeyInfo PEM public key", exc)]) from None
    if not isinstance(loaded, Ed25519PublicKey):
        raise ConfigError([f"{key} = {path!r}: expected an Ed25519 key, found another kind"])
    return Verifier(loaded)


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([f"{key} = {path!r}: cannot read it: {exc.strerror or exc}"]) from None


def _bad(key: str, path: str, expected: str, exc: Exception) -> str:
    why = str(exc).split("\n", 1)[0] or type(exc).__name__
    return f"{key} = {path!r}: expected {expected} (imexd keys create): {why}"


def key_problems(private_key: str, public_key: str) -> list[str]:
    """One line per `[control]` key that is set and cannot be loaded, and one when both
    are set and do not belong together (agents would drop every record written)."""
    problems: list[str] = []
    signer = verifier = None
    try:
        signer = load_signer(private_key) if private_key else None
    except ConfigError as exc:
        problems += exc.problems
    try:
        verifier = load_verifier(public_key) if public_key else None
    except ConfigError as exc:
        problems += exc.problems
    if signer is not None and verifier is not None:
        mine = signer.verifier().fingerprint
        if mine != verifier.fingerprint:
            problems.append(
                f"control.public_key = {public_key!r}: expected the public key of "
                f"control.private_key ({mine}), found {verifier.fingerprint}"
            )
    return problems


def create_keys(folder: str | os.PathLike[str]) -> tuple[Path, Path, str]:
    """Make a new key pair in `folder` (created when missing): control.key (PKCS8 PEM,
    mode 0600) and control.pub (SubjectPublicKeyInfo PEM, mode 0644); the two paths and
    the fingerprint. Refuses (KeysError, nothing written) an existing file of either."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 - lazy
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415 - lazy
        Ed25519PrivateKey,
    )

    where = Path(folder)
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise KeysError(f"{where}: not a directory") from None
    except OSError as exc:
        raise KeysError(f"{where}: cannot create it: {exc.strerror or exc}") from None
    if not where.is_dir():
        raise KeysError(f"{where}: not a directory")
    private, public = where / PRIVATE_KEY_FILE, where / PUBLIC_KEY_FILE
    taken = [str(p) for p in (private, public) if p.exists() or p.is_symlink()]
    if taken:
        raise KeysError(f"{' and '.join(taken)} already exist: not overwritten")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    pub = key.public_key()
    _write_new(private, pem, PRIVATE_KEY_MODE)
    try:
        _write_new(
            public,
            pub.public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
            PUBLIC_KEY_MODE,
        )
    except KeysError:
        private.unlink(missing_ok=True)
        raise
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return private, public, fingerprint(raw)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create `path` with `mode` (never an existing file: O_EXCL) and write `data`."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise KeysError(f"{path} already exists: not overwritten") from None
    except OSError as exc:
        raise KeysError(f"{path}: cannot create it: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(path, mode)  # the umask may have taken bits away
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise KeysError(f"{path}: cannot write it: {exc.strerror or exc}") from None
