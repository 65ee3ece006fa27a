"""Opening a NATS connection: credentials and TLS from the configuration, a first
connection bounded by a deadline, and quiet reconnects once it stands.

The first connection is made of single attempts (nats-py's own loop would retry it
forever, or ``max_reconnect_attempts`` times, printing each failure); `connect_policy`
decides between them. A refused login or TLS handshake raises `WalAccessDeniedError` at
once; a server that does not answer by the deadline `WalUnavailableError`. Once
connected, a client asked to reconnect ``forever`` does, without bound, and logs one
line when the connection drops and one when it is back, not one per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any, Literal

import nats.errors
from nats.aio.client import Client, RawCredentials

from buffered_store.backoff import Backoff
from buffered_store.config import ConnectionSettings
from buffered_store.errors import ConfigError, WalAccessDeniedError, WalUnavailableError
from buffered_store.masking import mask_credentials, mask_url
from buffered_store.nats.connect_policy import Failure, classify, describe

log = logging.getLogger("buffered_store.nats.wal")

Reconnect = Literal["forever", "never", "probe"]
DISCARD_TIMEOUT_S = 0.5
"""Longest wait for the close of a client whose connection attempt failed."""
RECONNECT_WAIT_S = 0.2
"""Wait between reconnection attempts to one server after a lost connection."""


class ConnectionLog:
    """The client's callbacks: one log line per change of the connection's state.

    While the client is connecting or reconnecting, each failed attempt is only counted
    (and logged at debug level); the loss of the connection is one warning
    (``nats_disconnected``), its return one line (``nats_reconnected``) with the number
    of failed attempts in between and the last error. Errors while connected (a slow
    consumer, a permissions violation) are warnings (``nats_error``).
    """

    def __init__(self, url: str, *, quiet: bool = False) -> None:
        self.url = mask_url(url)
        self.quiet = quiet
        self.connected = False
        """Set once the first connection stands; before it, failures are the caller's."""
        self.failed_attempts = 0
        self.last_error = ""
        self.client: Client | None = None

    async def on_error(self, exc: Exception) -> None:
        """nats-py's error callback (also called for every failed attempt)."""
        text = mask_credentials(describe(exc))
        client = self.client
        if self.quiet or not self.connected or client is None or not client.is_connected:
            self.failed_attempts += 1
            self.last_error = text
            log.debug("nats connection attempt failed: %s", text, extra={"action": "nats_error"})
            return
        log.warning("nats client error: %s", text, extra={"action": "nats_error"})

    async def on_disconnected(self) -> None:
        """The connection was lost (the client starts reconnecting unless closing)."""
        if not self.connected or self.quiet:
            return
        client = self.client
        if client is not None and client.is_closed:
            return  # closed on purpose
        self.failed_attempts = 0
        self.last_error = ""
        log.warning(
            "nats disconnected from %s; reconnecting",
            self.url,
            extra={"action": "nats_disconnected"},
        )

    async def on_reconnected(self) -> None:
        """The connection is back."""
        if self.quiet:
            return
        log.info(
            "nats reconnected after %d failed attempt(s)%s",
            self.failed_attempts,
            f" (last: {self.last_error})" if self.last_error else "",
            extra={"action": "nats_reconnected", "failed_attempts": self.failed_attempts},
        )
        self.failed_attempts = 0


def max_payload(nc: Client) -> int:
    """The largest message the connection's server takes (1 MiB until it has said)."""
    return int(getattr(nc, "max_payload", 0) or 1024 * 1024)


def tls_context(config: ConnectionSettings) -> ssl.SSLContext | None:
    """The TLS context the configuration asks for (None: nats-py's default, used when a
    server requires TLS or a URL says ``tls://``). `ConfigError` when a file is missing
    or unreadable."""
    if config.tls_ca_file is None and config.tls_cert_file is None:
        return None
    try:
        context = ssl.create_default_context(cafile=config.tls_ca_file)
        if config.tls_cert_file is not None:
            context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS files of the NATS connection: {exc}") from exc
    return context


def credentials_option(config: ConnectionSettings) -> Any:
    """The configured credentials in the form nats-py accepts: a file's path, or the
    file's contents (`ConfigError` when a file named does not exist)."""
    path = config.credentials_file()
    if path is None and config.credentials is not None:
        return RawCredentials(config.credentials)
    return path


async def open_client(
    config: ConnectionSettings,
    *,
    name: str,
    reconnect: Reconnect,
    timeout_s: float | None = None,
) -> Client:
    """A connected client, or an error of our family.

    `timeout_s` (default ``config.connect_timeout_s``) bounds the first connection, all
    attempts included. ``reconnect``: ``"forever"`` reconnects after any later loss,
    without bound; ``"never"`` gives up on a lost connection; ``"probe"`` too, makes a
    single pass over the servers (no retry: a refused connection fails at once) and logs
    nothing.
    """
    budget_s = config.connect_timeout_s if timeout_s is None else timeout_s
    shown = mask_url(config.nats_url)
    backoff = Backoff(initial_s=0.05, max_s=1.0, budget_s=budget_s)
    loop = asyncio.get_running_loop()
    events = ConnectionLog(config.nats_url, quiet=reconnect == "probe")
    options = _options(config, name, events)
    last: BaseException | None = None
    while True:
        left = backoff.left(loop.time())
        nc = Client()
        events.client = nc
        try:
            async with asyncio.timeout(left):
                # Every step of an attempt (TCP, TLS, INFO, CONNECT) waits at most this.
                step_s = max(0.01, min(left, config.request_timeout_s))
                await nc.connect(**options, connect_timeout=step_s)  # type: ignore[arg-type]
            break
        except BaseException as exc:
            await _discard(nc)
            if not isinstance(exc, Exception):
                raise  # cancelled (the caller gave up, e.g. on SIGTERM)
            failure = classify(exc)
            if failure is Failure.AUTH:
                raise WalAccessDeniedError(
                    f"NATS at {shown} refused the credentials ({mask_credentials(describe(exc))});"
                    " check the user, password, token or credentials file"
                ) from exc
            if failure is Failure.TLS:
                raise WalAccessDeniedError(
                    f"TLS with NATS at {shown} failed ({mask_credentials(describe(exc))}); check "
                    "tls_ca_file (the CA that signed the server's certificate) and the client "
                    "certificate"
                ) from exc
            if failure is Failure.CONFIG:
                raise ConfigError(
                    f"cannot connect to NATS at {shown}: {mask_credentials(describe(exc))}"
                ) from exc
            last = exc
            # A probe answers "down" after one pass over the servers: a health check
            # must not wait out its timeout for a refused connection.
            wait = backoff.next_wait(loop.time()) if reconnect != "probe" else None
            if wait is None:
                reason = "no answer in time" if isinstance(exc, TimeoutError) else describe(exc)
                if isinstance(exc, nats.errors.NoServersError) and events.last_error:
                    reason = events.last_error  # what the servers did, not nats-py's summary
                raise WalUnavailableError(
                    f"could not connect to NATS at {shown} within {budget_s:g} s "
                    f"({backoff.attempts} attempt(s); last: {mask_credentials(reason)})"
                ) from last
            await asyncio.sleep(wait)
    events.connected = True
    if reconnect == "forever":
        # From now on a lost connection is re-established however long it takes; the
        # first one was bounded by the loop above, which nats-py cannot do by itself.
        nc.options["allow_reconnect"] = True
        nc.options["max_reconnect_attempts"] = -1
    return nc


async def _discard(nc: Client) -> None:
    """Close a client whose attempt failed. Bounded: after a failed TLS handshake,
    nats-py's close can wait forever for the transport to shut down."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(DISCARD_TIMEOUT_S):
            await nc.close()


def _options(config: ConnectionSettings, name: str, events: ConnectionLog) -> dict[str, Any]:
    tls = tls_context(config)
    return {
        "servers": config.servers,
        "name": name,
        "user_credentials": credentials_option(config),
        "tls": tls,
        # One attempt per server and call: the retries are open_client's (with 0,
        # nats-py would try the servers forever; 1 allows a second pass).
        "allow_reconnect": False,
        "max_reconnect_attempts": 1,
        "reconnect_time_wait": RECONNECT_WAIT_S,
        "error_cb": events.on_error,
        "disconnected_cb": events.on_disconnected,
        "reconnected_cb": events.on_reconnected,
    }
