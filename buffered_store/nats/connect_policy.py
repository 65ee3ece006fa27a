"""Decisions of the first NATS connection, without I/O: which failures are worth another
attempt, how long to wait before it, and when to give up.

nats-py retries the *first* connection as often as it retries a lost one
(``max_reconnect_attempts``), so a store told to reconnect forever also waited forever,
printing an error per attempt, for a server that was down, a wrong password or a
certificate it does not trust. `connection.open_client` instead makes single attempts
and asks this module between them: a refused login or TLS handshake fails at once (the
same attempt will be refused again), anything else is tried again with a growing wait
until the budget of its `buffered_store.backoff.Backoff` runs out.
"""

from __future__ import annotations

import ssl
from enum import StrEnum

import nats.errors

AUTH_REFUSALS = (
    "authorization violation",
    "authentication timeout",
    "authentication expired",
    "authentication revoked",
    "user authentication",
    "account authentication",
)
"""What a NATS server's ``-ERR`` says when it refuses a client's credentials."""


class Failure(StrEnum):
    """What a failed connection attempt means for the next one."""

    AUTH = "auth"
    """The server refused the credentials: every attempt will be refused."""
    TLS = "tls"
    """The TLS handshake failed (an untrusted certificate, a missing client certificate):
    every attempt will fail the same way."""
    CONFIG = "config"
    """The client could not even try (invalid credentials file, bad options)."""
    TRANSIENT = "transient"
    """Unreachable, refused, reset or slow: the server may answer later."""


def classify(exc: BaseException) -> Failure:
    """What the failure of one connection attempt means."""
    if isinstance(exc, nats.errors.AuthorizationError):
        return Failure.AUTH
    if isinstance(exc, ssl.SSLError):  # before OSError, which it derives from
        return Failure.TLS
    if isinstance(exc, nats.errors.Error) and any(r in str(exc).lower() for r in AUTH_REFUSALS):
        return Failure.AUTH
    if isinstance(exc, OSError | TimeoutError | nats.errors.Error):
        return Failure.TRANSIENT
    return Failure.CONFIG


def describe(exc: BaseException) -> str:
    """A short text for an attempt's failure (its first line, type when it says nothing)."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"TLS: {exc.verify_message}"  # e.g. "self-signed certificate in chain"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text.removeprefix("nats: ").strip("'")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
