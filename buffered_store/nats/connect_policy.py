"""Decisions of the first NATS connection, without I/O: which failures are worth another
attempt, how long to wait before it, and when to give up.

nats-py retries the *first* connection as often as it retries a lost one
(``max_reconnect_attempts``), so a store told to reconnect forever also waited forever,
printing an error per attempt, for a server that was down, a wrong password or a
certificate it does not trust. `connection.open_client` instead makes single attempts
and asks this module between them: a refused login or TLS handshake fails at once (the
same attempt will be refused again), anything else is tried again with a growing wait
until `ConnectBackoff`'s deadline.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class ConnectBackoff:
    """Waits between attempts of the first connection, all within `budget_s`.

    The deadline is set by the first call of `left` or `next_wait` (given ``now``, a
    monotonic time in seconds: nothing here reads a clock). Waits double from
    `initial_s` up to `max_s` and never reach past the deadline.
    """

    budget_s: float
    initial_s: float = 0.05
    max_s: float = 1.0
    attempts: int = 0
    """Attempts that failed so far (counted by `next_wait`)."""
    _deadline: float | None = field(default=None, repr=False)
    _delay: float = field(default=0.0, repr=False)

    def left(self, now: float) -> float:
        """Seconds left until the deadline (never negative)."""
        if self._deadline is None:
            self._deadline = now + self.budget_s
        return max(0.0, self._deadline - now)

    def next_wait(self, now: float) -> float | None:
        """After a failed attempt: how long to wait before the next one, or None to give
        up (the wait would end at or past the deadline)."""
        left = self.left(now)
        self.attempts += 1
        self._delay = self.initial_s if self._delay == 0.0 else min(2 * self._delay, self.max_s)
        if self._delay >= left:
            return None
        return self._delay
