"""The tests' Mosquitto: the demo's launcher with what tests and benchmarks ask of a
broker besides, and Mosquitto running the shipped production configuration.

`Mosquitto` is the demo's launcher (`imexd.demo.brokers.Mosquitto`: a free port of
127.0.0.1, start, stop, restart on the same port) plus a store that survives a restart
(`persistence`), directives of the test's own (`extra_config`) and a Unix socket
listener (`unix_socket`). Every test and benchmark starts its Mosquitto with it.

`ShippedBroker` starts a real Mosquitto with config/mosquitto.conf and
config/mosquitto.acl, changing only what a test must: the listener's port and address,
file paths, and (for password mode) the lines an operator would flip. The ACL is copied
byte for byte. `Pki` is a throwaway CA (trustme) with the broker's certificate and one
client certificate per name, CN = the name, written to files as an operator would.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiomqtt
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from imexd.demo import brokers

REPO = Path(__file__).resolve().parent.parent
SHIPPED_CONF = REPO / "config" / "mosquitto.conf"
SHIPPED_ACL = REPO / "config" / "mosquitto.acl"
CONTROL_USER = "imexd_control"
"""The control plane's user name (its certificate's CN) in config/mosquitto.acl."""
CLIENT_SAN = "client@imexd.invalid"
"""The subjectAltName of every client certificate (`Pki.client`)."""


class Mosquitto(brokers.Mosquitto):
    """A real Mosquitto on a free port of 127.0.0.1, with a throwaway config in `workdir`
    (and optionally a Unix socket); `persistence` decides whether the retained state
    survives a `stop()` then `start()`."""

    def __init__(
        self,
        workdir: Path,
        *,
        persistence: bool = False,
        extra_config: str = "",
        unix_socket: bool = False,
        binary: str | None = None,
    ) -> None:
        super().__init__(workdir, binary=binary)
        self.persistence = persistence
        self.extra_config = extra_config
        self.socket_path = str(workdir / "mqtt.sock") if unix_socket else None

    def config_lines(self) -> list[str]:
        lines = super().config_lines()
        if any(line.split()[:1] == ["user"] for line in self.extra_config.splitlines()):
            lines.remove("user root")  # Mosquitto refuses a second `user` line
        lines += [
            f"persistence {'true' if self.persistence else 'false'}",
            f"persistence_location {self.workdir}/",
        ]
        if self.socket_path:
            lines += [f"listener 0 {self.socket_path}", "allow_anonymous true"]
        if self.extra_config:
            lines.append(self.extra_config)
        return lines


@dataclass(frozen=True, slots=True)
class Identity:
    """A client certificate and its private key, as files."""

    name: str
    cert_file: Path
    key_file: Path


class Pki:
    """A throwaway CA with the broker's certificate (127.0.0.1, localhost) and clients'."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.ca = trustme.CA()
        self.ca_file = folder / "ca.crt"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        self.server_cert = folder / "server.crt"
        self.server_key = folder / "server.key"
        server.cert_chain_pems[0].write_to_path(str(self.server_cert))
        server.private_key_pem.write_to_path(str(self.server_key))
        self._clients: dict[str, Identity] = {}
        self._serials: dict[str, int] = {}

    def client(self, name: str) -> Identity:
        """The certificate with CN = `name` (a node name or the control plane's user).

        Its subjectAltName is one fixed e-mail address: the broker reads the CN only
        (`use_identity_as_username`), and cryptography 51 refuses a certificate with an
        empty subjectAltName, which is what trustme makes for a CN alone."""
        if name not in self._clients:
            issued = self.ca.issue_cert(CLIENT_SAN, common_name=name)
            ident = Identity(name, self.folder / f"{name}.crt", self.folder / f"{name}.key")
            issued.cert_chain_pems[0].write_to_path(str(ident.cert_file))
            issued.private_key_pem.write_to_path(str(ident.key_file))
            self._clients[name] = ident
            cert = x509.load_pem_x509_certificate(issued.cert_chain_pems[0].bytes())
            self._serials[name] = cert.serial_number
        return self._clients[name]

    def revocation_list(self, *names: str) -> Path:
        """A PEM CRL, signed by the CA, revoking the client certificates of `names`."""
        key = serialization.load_pem_private_key(self.ca.private_key_pem.bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey)
        issuer = x509.load_pem_x509_certificate(self.ca.cert_pem.bytes()).subject
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(issuer)
            .last_update(now - dt.timedelta(minutes=1))
            .next_update(now + dt.timedelta(days=1))
        )
        for name in names:
            self.client(name)
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(self._serials[name])
                .revocation_date(now - dt.timedelta(minutes=1))
                .build()
            )
        path = self.folder / "crl.pem"
        path.write_bytes(
            builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        )
        return path


def render_config(text: str, settings: Mapping[str, str]) -> str:
    """`text` with the value of each directive in `settings` replaced.

    A directive must be set exactly once, or be present exactly once as a commented-out
    line (`#name value`), which is then enabled, as an operator would. Anything else is an
    error, so the tests notice when the shipped file changes shape.
    """
    lines = text.splitlines()
    for name, value in settings.items():
        active = [i for i, line in enumerate(lines) if re.match(rf"{re.escape(name)}(\s|$)", line)]
        if not active:
            active = [i for i, line in enumerate(lines) if re.match(rf"#{re.escape(name)}\s", line)]
        if len(active) != 1:
            raise AssertionError(f"{name!r} is set {len(active)} times in the shipped config")
        lines[active[0]] = f"{name} {value}"
    return "\n".join(lines) + "\n"


class ShippedBroker(Mosquitto):
    """A real Mosquitto running the shipped mosquitto.conf and mosquitto.acl.

    Certificate mode as shipped; `passwords` switches to password mode the way the
    config's comments tell an operator to (no client certificates, a password file);
    `crl_file` and `username_as_clientid` enable the commented-out lines that say so.
    """

    def __init__(
        self,
        workdir: Path,
        pki: Pki,
        *,
        passwords: Mapping[str, str] | None = None,
        crl_file: Path | None = None,
        username_as_clientid: bool = False,
    ) -> None:
        super().__init__(workdir, persistence=True)
        self.pki = pki
        self.passwords = passwords
        self.crl_file = crl_file
        self.username_as_clientid = username_as_clientid
        self.acl_path = workdir / "mosquitto.acl"
        self.acl_path.write_bytes(SHIPPED_ACL.read_bytes())

    @property
    def url(self) -> str:
        return f"mqtts://{self.host}:{self.port}"

    def config_text(self) -> str:
        settings = {
            "listener": f"{self.port} {self.host}",
            "acl_file": str(self.acl_path),
            "cafile": str(self.pki.ca_file),
            "certfile": str(self.pki.server_cert),
            "keyfile": str(self.pki.server_key),
            "persistence_location": f"{self.workdir}/",
        }
        if self.crl_file is not None:
            settings["crlfile"] = str(self.crl_file)
        if self.username_as_clientid:
            settings["use_username_as_clientid"] = "true"
        if self.passwords is not None:
            passwd = self.workdir / "passwd"
            passwd.unlink(missing_ok=True)
            for user, password in self.passwords.items():
                create = [] if passwd.exists() else ["-c"]
                subprocess.run(
                    ["mosquitto_passwd", "-b", *create, str(passwd), user, password],
                    check=True,
                    capture_output=True,
                    timeout=10,
                )
            settings |= {
                "require_certificate": "false",
                "use_identity_as_username": "false",
                "password_file": str(passwd),
            }
        text = render_config(SHIPPED_CONF.read_text(), settings)
        if os.geteuid() == 0:
            # As root Mosquitto drops to user mosquitto, who cannot read the test's files.
            text += "user root\n"
        return text

    def tls(self, identity: Identity | None) -> aiomqtt.TLSParameters:
        """What imexd builds from bus.ca_file, bus.cert_file and bus.key_file."""
        return aiomqtt.TLSParameters(
            ca_certs=str(self.pki.ca_file),
            certfile=str(identity.cert_file) if identity else None,
            keyfile=str(identity.key_file) if identity else None,
        )
