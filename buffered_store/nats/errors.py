"""Translating nats-py's failures into the store's error family, in one place."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import NoReturn

import nats.errors
import nats.js.errors as jse

from buffered_store.errors import (
    ConflictError,
    PayloadTooLargeError,
    StoreError,
    WalFullError,
    WalRefusedError,
    WalUnavailableError,
)

WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code of a publish whose expected last subject sequence failed."""
KV_WRONG_LAST = (WRONG_LAST_SEQUENCE, 10164)
"""Error codes of a KV compare-and-set that found another revision (as `KeyValue.update`)."""
NO_RESPONDERS_FIRST_WAIT_S = 0.005
NO_RESPONDERS_MAX_WAIT_S = 0.1
"""A request nobody received (a stream, bucket or scan consumer the node talked to has not
learnt of yet) is sent again after these waits, doubling, within the call's budget: by
`requests.until_answered` and by a scan's pull requests alike."""
NO_PEERS = 10005
"""JetStream's error code of a stream or consumer it cannot place: fewer servers of the
cluster up (or known to the meta leader) than the replicas asked for."""
STORE_FULL = (10077, 10023)
"""JetStream's error codes of a publish refused for lack of room: the stream's
``max_bytes`` reached with discard policy "new" (10077, "maximum bytes exceeded"),
or the server's JetStream storage exhausted (10023, "insufficient resources")."""


@asynccontextmanager
async def translated(what: str) -> AsyncIterator[None]:
    """Re-raise nats/asyncio failures of `what` as our errors (`translation`)."""
    try:
        yield
    except Exception as exc:
        raise_translated(exc, lambda: what)


def raise_translated(exc: Exception, what: Callable[[], str]) -> NoReturn:
    """Raise our error for `exc` (`translation`) from it, or `exc` itself: `translated`
    for a plain ``except``, where a call on the write path or per delivered message
    should not pay for an async context manager."""
    ours = translation(exc, what)
    if ours is None:
        raise exc
    raise ours from exc


def translation(exc: Exception, what: Callable[[], str]) -> StoreError | None:
    """Our error for a nats/asyncio failure of `what()` (asked only on failure), None
    for one of ours (re-raise it) or one we do not translate.

    `translated` is this as a context manager; the write path's append and the flusher's
    acks use `raise_translated` in a plain ``except`` instead: an async context manager
    per call costs about as much as the rest of the append's own Python code.
    """
    if isinstance(exc, StoreError):
        return None
    if isinstance(exc, jse.KeyWrongLastSequenceError):
        return ConflictError(f"{what()}: the key changed meanwhile")
    if isinstance(exc, jse.APIError):
        if exc.err_code == WRONG_LAST_SEQUENCE:
            return ConflictError(f"{what()}: another entry was appended meanwhile")
        if exc.err_code in STORE_FULL:
            return WalFullError(
                f"{what()}: the WAL is full ({exc.description}); retry once the flushers "
                "have drained it"
            )
        if isinstance(exc, jse.ServiceUnavailableError):
            return WalUnavailableError(f"{what()}: JetStream unavailable ({exc})")
        if exc.err_code == NO_PEERS:  # a node down or restarting: placeable once it is back
            return WalUnavailableError(
                f"{what()}: JetStream cannot place it with fewer servers up than replicas "
                f"({exc.description})"
            )
        return WalRefusedError(f"{what()}: JetStream refused the request ({exc})")
    if isinstance(
        exc,
        TimeoutError
        | nats.errors.TimeoutError
        | nats.errors.ConnectionClosedError
        | nats.errors.NoServersError
        | nats.errors.NoRespondersError
        | nats.errors.StaleConnectionError
        | nats.errors.OutboundBufferLimitError
        | jse.NoStreamResponseError
        | ConnectionError
        | OSError,
    ):
        return WalUnavailableError(f"{what()}: NATS unavailable ({type(exc).__name__})")
    if isinstance(exc, nats.errors.MaxPayloadError):  # refused by the client: nothing sent
        return PayloadTooLargeError(f"{what()}: larger than the server accepts ({exc})")
    if isinstance(exc, nats.errors.Error):  # refused by the client: invalid key, draining
        return WalRefusedError(f"{what()}: refused ({type(exc).__name__}: {exc})")
    return None
