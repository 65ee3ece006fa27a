"""`buffered_store.nats.errors.translated`: every nats-py failure becomes the class of
our family that names what a caller decides on it, never the root `StoreError`."""

from __future__ import annotations

import nats.errors
import nats.js.errors as jse
import pytest

from buffered_store.errors import (
    ConflictError,
    PayloadTooLargeError,
    StoreError,
    WalFullError,
    WalRefusedError,
    WalUnavailableError,
)
from buffered_store.nats.errors import translated


def api_error(code: int, err_code: int, description: str) -> jse.APIError:
    error = jse.APIError(code=code, err_code=err_code, description=description)
    return error


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (jse.KeyWrongLastSequenceError(), ConflictError),
        (api_error(400, 10071, "wrong last sequence: 4"), ConflictError),
        (api_error(400, 10077, "maximum bytes exceeded"), WalFullError),
        (jse.ServiceUnavailableError(), WalUnavailableError),
        (api_error(400, 10052, "invalid JSON"), WalRefusedError),
        (jse.NotFoundError(), WalRefusedError),
        (nats.errors.TimeoutError(), WalUnavailableError),
        (nats.errors.NoRespondersError(), WalUnavailableError),
        (ConnectionResetError(), WalUnavailableError),
        (nats.errors.MaxPayloadError(), PayloadTooLargeError),
        (nats.errors.ConnectionDrainingError(), WalRefusedError),
        (nats.errors.BadSubjectError(), WalRefusedError),
    ],
)
async def test_each_failure_has_its_class(raised: Exception, expected: type[StoreError]) -> None:
    with pytest.raises(StoreError) as caught:
        async with translated("the request"):
            raise raised
    assert type(caught.value) is expected
    assert caught.value.__cause__ is raised
    assert str(caught.value).startswith("the request: ")


async def test_our_own_errors_pass_through_untouched() -> None:
    error = WalFullError("full")
    with pytest.raises(WalFullError) as caught:
        async with translated("the request"):
            raise error
    assert caught.value is error
