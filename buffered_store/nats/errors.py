"""Translating nats-py's failures into the store's error family, in one place."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
STORE_FULL = (10077, 10023)
"""JetStream's error codes of a publish refused for lack of room: the stream's
``max_bytes`` reached with discard policy "new" (10077, "maximum bytes exceeded"),
or the server's JetStream storage exhausted (10023, "insufficient resources")."""


@asynccontextmanager
async def translated(what: str) -> AsyncIterator[None]:
    """Re-raise nats/asyncio failures of `what` as our errors."""
    try:
        yield
    except StoreError:
        raise
    except jse.KeyWrongLastSequenceError as exc:
        raise ConflictError(f"{what}: the key changed meanwhile") from exc
    except jse.APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:
            raise ConflictError(f"{what}: another entry was appended meanwhile") from exc
        if exc.err_code in STORE_FULL:
            raise WalFullError(
                f"{what}: the WAL is full ({exc.description}); retry once the flushers "
                "have drained it"
            ) from exc
        if isinstance(exc, jse.ServiceUnavailableError):
            raise WalUnavailableError(f"{what}: JetStream unavailable ({exc})") from exc
        raise WalRefusedError(f"{what}: JetStream refused the request ({exc})") from exc
    except (
        TimeoutError,
        nats.errors.TimeoutError,
        nats.errors.ConnectionClosedError,
        nats.errors.NoServersError,
        nats.errors.NoRespondersError,
        nats.errors.StaleConnectionError,
        nats.errors.OutboundBufferLimitError,
        jse.NoStreamResponseError,
        ConnectionError,
        OSError,
    ) as exc:
        raise WalUnavailableError(f"{what}: NATS unavailable ({type(exc).__name__})") from exc
    except nats.errors.MaxPayloadError as exc:  # refused by the client: nothing was sent
        raise PayloadTooLargeError(f"{what}: larger than the server accepts ({exc})") from exc
    except nats.errors.Error as exc:  # refused by the client: invalid key, draining
        raise WalRefusedError(f"{what}: refused ({type(exc).__name__}: {exc})") from exc
