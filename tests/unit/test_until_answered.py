"""`until_answered` and `may_appear` without a server: what is sent again, with how much
time, and when the call gives up."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import nats.errors
import pytest
from nats.aio.msg import Msg

from buffered_store.nats.requests import may_appear, until_answered

REPLY = Msg(_client=None, subject="reply", data=b"ok")  # type: ignore[arg-type]


def nobody_then_reply(silent: int, timeouts: list[float]) -> Callable[[float], Awaitable[Msg]]:
    """A `send` answered "no responders" `silent` times, then with `REPLY`."""

    async def send(timeout_s: float) -> Msg:
        timeouts.append(timeout_s)
        if len(timeouts) <= silent:
            raise nats.errors.NoRespondersError
        return REPLY

    return send


async def test_the_first_send_has_the_whole_budget_and_each_next_only_what_is_left() -> None:
    timeouts: list[float] = []
    assert await until_answered(nobody_then_reply(3, timeouts), 2.0) is REPLY
    assert len(timeouts) == 4
    assert timeouts[0] == 2.0
    assert all(later < earlier for earlier, later in itertools.pairwise(timeouts))
    # The waits between sends (5, 10, 20 ms) are taken out of the budget.
    assert timeouts[-1] <= 2.0 - 0.035


async def test_it_gives_up_with_no_responders_once_the_budget_is_spent() -> None:
    timeouts: list[float] = []
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(nats.errors.NoRespondersError):
        await until_answered(nobody_then_reply(10_000, timeouts), 0.3)
    assert len(timeouts) > 3
    assert loop.time() - began < 0.3 + 0.1  # never a wait past the budget (one 100 ms at most)


async def test_other_errors_are_not_retried() -> None:
    calls = 0

    async def send(timeout_s: float) -> Msg:
        nonlocal calls
        calls += 1
        raise nats.errors.TimeoutError

    with pytest.raises(nats.errors.TimeoutError):
        await until_answered(send, 2.0)
    assert calls == 1


@pytest.mark.parametrize(
    ("subject", "expected"),
    [
        ("THREADLOG.t.abc", True),  # a stream's subject: the stream may be on its way
        ("$KV.thread-hot.h.abc", True),  # a bucket's key
        ("$JS.API.DIRECT.GET.KV_thread-hot.$KV.thread-hot.h.abc", True),  # its replicas
        ("$JS.API.STREAM.INFO.THREADLOG", False),  # any JetStream server answers these
        ("$JS.API.STREAM.MSG.GET.THREADLOG", False),
        ("$JS.API.CONSUMER.CREATE.THREADLOG", False),
    ],
)
def test_which_subjects_may_appear(subject: str, expected: bool) -> None:
    assert may_appear(subject) is expected
