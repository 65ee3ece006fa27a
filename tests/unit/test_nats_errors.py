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
from buffered_store.nats.errors import translated, translation


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
        (api_error(400, 10005, "no suitable peers for placement"), WalUnavailableError),
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


@pytest.mark.parametrize(
    "raised",
    [
        jse.KeyWrongLastSequenceError(),
        api_error(400, 10071, "wrong last sequence: 4"),
        api_error(503, 10077, "maximum bytes exceeded"),
        jse.ServiceUnavailableError(),
        nats.errors.TimeoutError(),
        ConnectionResetError(),
        nats.errors.MaxPayloadError(),
        nats.errors.BadSubjectError(),
        WalFullError("ours"),
        ValueError("not a nats failure"),
    ],
)
async def test_translation_is_what_translated_raises(raised: Exception) -> None:
    ours = translation(raised, lambda: "the request")
    with pytest.raises(Exception) as caught:  # noqa: PT011 - compared just below
        async with translated("the request"):
            raise raised
    if ours is None:
        assert caught.value is raised  # ours already, or not nats's: passes through
    else:
        assert type(caught.value) is type(ours)
        assert str(caught.value) == str(ours)
        assert caught.value.__cause__ is raised


def test_the_description_is_made_only_on_a_failure_translated() -> None:
    def what() -> str:
        raise AssertionError("asked for nothing")

    assert translation(WalFullError("ours"), what) is None
    assert translation(ValueError("other"), what) is None


async def test_our_own_errors_pass_through_untouched() -> None:
    error = WalFullError("full")
    with pytest.raises(WalFullError) as caught:
        async with translated("the request"):
            raise error
    assert caught.value is error
