"""Servers that demand credentials or TLS, for the access tests: certificates made with
openssl, NATS operator-mode credentials made with nkeys, and the server configurations.

A creds file needs a NATS server in operator mode (JWT accounts). Without `nsc` on the
machine, the operator, account and user JWTs are signed here with nkeys (ed25519), in
the JWT v2 layout the server checks (header ``ed25519-nkey``, claims with ``iss``,
``sub``, ``nats.type``), and the account is preloaded into a ``MEMORY`` resolver with
JetStream limits so streams and buckets can be made.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import nacl.signing
import nkeys  # type: ignore[import-untyped]

PASSWORD = "Planted-Secret-7q4Z"
"""The one password of the user/password server: tests check it never shows."""


@dataclass(frozen=True)
class Certs:
    """PEM files of a private CA, a server certificate for 127.0.0.1/localhost and a
    client certificate it signed, plus a CA that signed neither."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(folder: Path, name: str) -> tuple[Path, Path]:
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert),
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip
    return cert, key


def _signed(folder: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    key, csr, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
    extfile = folder / f"{name}.ext"
    extfile.write_text(ext)
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
        "-keyout", str(key), "-out", str(csr), cwd=folder,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
        "-CAcreateserial", "-days", "2", "-out", str(cert), "-extfile", str(extfile),
        cwd=folder,
    )  # fmt: skip
    return cert, key


def make_certs(folder: Path) -> Certs:
    """A CA, a server and a client certificate signed by it, and an unrelated CA."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = _ca(folder, "test-ca")
    server = _signed(
        folder,
        "server",
        ca,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    client = _signed(folder, "client", ca, "extendedKeyUsage=clientAuth\n")
    other, _ = _ca(folder, "other-ca")
    return Certs(ca[0], server[0], server[1], client[0], client[1], other)


def auth_config(password: str = PASSWORD) -> str:
    """A server accepting one user, ``svc``, with `password`."""
    return f'authorization {{\n  user: svc\n  password: "{password}"\n}}\n'


def tls_config(certs: Certs, *, verify_clients: bool) -> str:
    """A server requiring TLS with the test CA's server certificate; with
    `verify_clients`, clients must present a certificate that CA signed."""
    return (
        "tls {\n"
        f'  cert_file: "{certs.server_cert}"\n'
        f'  key_file: "{certs.server_key}"\n'
        f'  ca_file: "{certs.ca}"\n'
        f"  verify: {'true' if verify_clients else 'false'}\n"
        "  timeout: 2\n"
        "}\n"
    )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int) -> nkeys.KeyPair:
    raw = bytes(nacl.signing.SigningKey.generate())
    return nkeys.from_seed(bytearray(nkeys.encode_seed(raw, prefix)))


def _jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats_claims: dict[str, object]) -> str:
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims = {
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": {**nats_claims, "version": 2},
    }
    claims["jti"] = base64.b32encode(
        hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    ).decode()
    body = _b64(json.dumps(claims).encode())
    signature = issuer.sign(f"{header}.{body}".encode())
    return f"{header}.{body}.{_b64(signature)}"


@dataclass(frozen=True)
class Operator:
    """An operator-mode server configuration and a user's creds file text."""

    server_config: str
    creds: str


def make_operator() -> Operator:
    """An operator, one account with JetStream, one user of it (and the system account
    JetStream needs in operator mode)."""
    operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    system_pub = system.public_key.decode()
    user = _keypair(nkeys.PREFIX_BYTE_USER)
    operator_pub = operator.public_key.decode()
    account_pub = account.public_key.decode()
    unlimited = {
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": True, "conn": -1, "leaf": -1,
        "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
    }  # fmt: skip
    operator_jwt = _jwt(operator, operator_pub, "test-operator", {"type": "operator"})
    account_jwt = _jwt(
        operator, account_pub, "test-account", {"type": "account", "limits": unlimited}
    )
    system_jwt = _jwt(operator, system_pub, "SYS", {"type": "account"})
    user_jwt = _jwt(
        account,
        user.public_key.decode(),
        "svc",
        {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1},
    )
    seed = user.seed.decode()
    creds = (
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
    config = (
        f'operator: "{operator_jwt}"\n'
        f"system_account: {system_pub}\n"
        "resolver: MEMORY\n"
        f'resolver_preload: {{\n  {account_pub}: "{account_jwt}"\n'
        f'  {system_pub}: "{system_jwt}"\n}}\n'
    )
    return Operator(config, creds)
