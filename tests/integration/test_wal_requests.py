"""`ReplyInbox`, the request/reply of the write path's two round trips: every reply
reaches its own request, and failures come out as nats-py's `Client.request` raises
them (so `translated` maps them to our errors as before). A request nobody listens to
is sent again until someone does or its time is up (`until_answered`), on every request
`NatsWal` makes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.keys import hot_key
from buffered_store.engine.ports import KvValue
from buffered_store.errors import WalObjectMissingError, WalUnavailableError
from buffered_store.nats import NatsWal
from buffered_store.nats.requests import EXPIRY_SLACK_S, Dispatch, ReplyInbox, until_answered
from tests.plugins.stores import ConfigFactory, jetstream


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


async def test_concurrent_requests_each_get_their_own_reply(nc: Client) -> None:
    async def answer(msg: Msg) -> None:
        # Answer out of order: later requests first, after a short, varying delay.
        await asyncio.sleep(0.02 - int(msg.data) * 0.0002)
        tag = (msg.headers or {}).get("X-Tag", "")
        await msg.respond(msg.data + b":" + tag.encode())

    await nc.subscribe("rq.echo", cb=answer)
    inbox = ReplyInbox(nc)
    replies = await asyncio.gather(
        *(
            inbox.request("rq.echo", str(i).encode(), {"X-Tag": f"t{i}"}, timeout_s=5)
            for i in range(60)
        )
    )
    assert [r.data for r in replies] == [f"{i}:t{i}".encode() for i in range(60)]


async def test_a_failing_handler_leaves_the_clients_read_loop_running(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler run in the read loop (`Dispatch`) that raises must not end the loop:
    nats-py would log it and stop reading, and every later reply would be lost."""
    got: list[bytes] = []
    arrived = asyncio.Event()

    def deliver(msg: Msg) -> None:
        if msg.data == b"bad":
            raise ValueError("a handler's bug")
        got.append(msg.data)
        arrived.set()

    inbox = nc.new_inbox()
    await nc.subscribe(inbox, future=Dispatch(asyncio.get_running_loop(), deliver))
    for data in (b"bad", b"good"):
        await nc.publish(inbox, data)
    await nc.flush()
    await asyncio.wait_for(arrived.wait(), 5)
    assert got == [b"good"]
    # And requests still get their replies on the same connection.
    assert await ReplyInbox(nc).request("$JS.API.INFO", b"", None, timeout_s=5)
    assert any(getattr(r, "action", None) == "dispatch_failed" for r in caplog.records)


async def test_a_subject_nobody_serves_raises_no_responders(nc: Client) -> None:
    inbox = ReplyInbox(nc)
    with pytest.raises(nats.errors.NoRespondersError):
        await inbox.request("rq.nobody", b"x", {"X-Tag": "t"}, timeout_s=5)


async def test_a_request_not_answered_in_time_times_out_and_the_others_still_answer(
    nc: Client,
) -> None:
    """One timer serves every waiting request: it fails the late one at its deadline,
    a shorter deadline set later comes first, and the answers of the rest arrive."""
    silent: list[Msg] = []

    async def answer(msg: Msg) -> None:
        if msg.data.startswith(b"mute"):
            silent.append(msg)  # never answered
            return
        await asyncio.sleep(0.15)
        await msg.respond(b"ok:" + msg.data)

    await nc.subscribe("rq.some", cb=answer)
    inbox = ReplyInbox(nc)
    arms: list[float] = []
    arm = inbox._deadlines._arm

    def counting_arm(loop: asyncio.AbstractEventLoop, at: float) -> None:
        arms.append(at)
        arm(loop, at)

    inbox._deadlines._arm = counting_arm  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def ask(data: bytes, timeout_s: float) -> tuple[bytes | None, float]:
        try:
            reply = await inbox.request("rq.some", data, {"X-Tag": "t"}, timeout_s=timeout_s)
        except nats.errors.TimeoutError:
            return None, loop.time() - started
        return reply.data, loop.time() - started

    results = await asyncio.gather(
        ask(b"mute-long", 0.6),
        *(ask(str(i).encode(), 5) for i in range(20)),
        ask(b"mute-short", 0.3),
    )
    long_wait, *answered, short_wait = results
    assert [data for data, _ in answered] == [f"ok:{i}".encode() for i in range(20)]
    assert long_wait[0] is None
    assert short_wait[0] is None
    # Never before its deadline (a loop may run the timer a moment early: the slack).
    assert short_wait[1] >= 0.3 - EXPIRY_SLACK_S
    assert long_wait[1] >= 0.6 - EXPIRY_SLACK_S
    assert len(silent) == 2
    # Armed for the first request, re-armed for the shorter deadline set after it, and
    # again by each expiry for the next deadline: never once per request.
    assert len(arms) <= 4
    assert not inbox._waiting


async def test_until_answered_sends_again_while_nobody_listens_then_gives_up(
    nc: Client,
) -> None:
    inbox = ReplyInbox(nc)
    sent = 0

    async def send(timeout_s: float) -> Msg:
        nonlocal sent
        sent += 1
        return await inbox.request("rq.nobody", b"x", {"X-Tag": "t"}, timeout_s=timeout_s)

    with pytest.raises(nats.errors.NoRespondersError):
        await until_answered(send, 0.3)
    assert sent > 2


async def test_a_request_sent_before_anyone_listens_gets_the_first_listeners_reply(
    nc: Client,
) -> None:
    """What a stream just created on a cluster looks like to a client: "no responders"
    for a moment, then an answer."""

    async def answer(msg: Msg) -> None:
        await msg.respond(b"here:" + msg.data)

    async def listen_later() -> None:
        await asyncio.sleep(0.15)
        await nc.subscribe("rq.late", cb=answer)

    listening = asyncio.create_task(listen_later())
    inbox = ReplyInbox(nc)
    reply = await until_answered(
        lambda left: inbox.request("rq.late", b"x", {"X-Tag": "t"}, timeout_s=left), 5
    )
    await listening
    assert reply.data == b"here:x"


async def test_the_wal_waits_for_a_stream_and_a_bucket_that_appear_while_it_asks(
    config: BufferedStoreConfig,
) -> None:
    """Writes and reads through `NatsWal` (its own reply inbox and nats-py's request path
    alike) succeed when the stream or bucket shows up within the request timeout."""
    wal = await NatsWal.connect(config)
    subject = f"{config.stream_name}.t.x"
    try:
        async with jetstream(config) as js:
            stream = (await js.stream_info(config.stream_name)).config
            bucket = (await js.stream_info(f"KV_{config.hot_bucket}")).config
            await js.delete_stream(config.stream_name)
            await js.delete_stream(f"KV_{config.hot_bucket}")
            async with reappearing(js, stream, bucket):
                published, revision = await asyncio.gather(
                    wal.publish(subject, b"e", msg_id="m", expected_last_subject_seq=0),
                    wal.kv_put(hot_key("x"), b"h"),
                )
            assert published == (1, False)
            assert revision == 1
            assert (await wal.kv_get(hot_key("x"))) == KvValue(b"h", 1)
            await js.delete_stream(f"KV_{config.hot_bucket}")
            before = wal.requests
            async with reappearing(js, bucket):
                found = await wal.kv_get(hot_key("x"))
            # The new bucket is empty. Seen once in a full run (not reproduced in 300 runs
            # under load): the old value. The count of sends tells, should it recur,
            # whether the deleted bucket still answered (1) or the new one did (more).
            assert found is None, f"{found} after {wal.requests - before} sends"
    finally:
        await wal.close()


@asynccontextmanager
async def reappearing(js: JetStreamContext, *streams: StreamConfig) -> AsyncIterator[None]:
    """Create `streams` 150 ms after the body starts (and wait for that at its end)."""

    async def later() -> None:
        await asyncio.sleep(0.15)
        for stream in streams:
            await js.add_stream(stream)

    task = asyncio.create_task(later())
    try:
        yield
    finally:
        await task


async def test_the_wal_gives_up_on_a_stream_that_never_appears(
    make_config: ConfigFactory,
) -> None:
    config = make_config(request_timeout_s=0.3)
    wal = await NatsWal.connect(config)
    try:
        async with jetstream(config) as js:
            await js.delete_stream(config.stream_name)
        before = wal.requests
        with pytest.raises(WalUnavailableError):
            await wal.publish(
                f"{config.stream_name}.t.x", b"e", msg_id="m1", expected_last_subject_seq=0
            )
        assert wal.requests - before > 2, "sent again while nobody listened"
    finally:
        await wal.close()


async def test_an_unanswered_request_times_out_and_its_late_reply_is_dropped(
    nc: Client,
) -> None:
    held: list[Msg] = []

    async def hold(msg: Msg) -> None:
        held.append(msg)  # answered only after the requester gave up

    async def answer(msg: Msg) -> None:
        await msg.respond(b"ok")

    await nc.subscribe("rq.slow", cb=hold)
    await nc.subscribe("rq.fast", cb=answer)
    inbox = ReplyInbox(nc)
    began = time.monotonic()
    with pytest.raises(nats.errors.TimeoutError):
        await inbox.request("rq.slow", b"x", {"X-Tag": "t"}, timeout_s=0.2)
    assert 0.15 < time.monotonic() - began < 2
    await held[0].respond(b"late")
    # The late reply matches no waiting request; the next request gets its own.
    reply = await inbox.request("rq.fast", b"y", {"X-Tag": "t"}, timeout_s=5)
    assert reply.data == b"ok"


async def test_requests_on_a_closed_connection_fail_and_do_not_hang(nc: Client) -> None:
    inbox = ReplyInbox(nc)
    await nc.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await asyncio.wait_for(inbox.request("rq.any", b"x", {"X-Tag": "t"}, timeout_s=5), 10)


async def test_concurrent_unanswered_requests_each_time_out_at_their_own_timeout(
    nc: Client,
) -> None:
    """Each of several concurrent requests fails at its own time, one that is answered
    meanwhile is unaffected, and requests made after the inbox was idle time out too."""

    async def answer(msg: Msg) -> None:
        await asyncio.sleep(0.25)
        await msg.respond(b"ok")

    async def ignore(msg: Msg) -> None:
        pass  # received, never answered

    await nc.subscribe("rq.held", cb=ignore)
    await nc.subscribe("rq.later", cb=answer)
    inbox = ReplyInbox(nc)

    async def timed(subject: str, timeout_s: float) -> tuple[float, Msg | None]:
        began = time.monotonic()
        try:
            reply = await inbox.request(subject, b"x", {"X-Tag": "t"}, timeout_s=timeout_s)
        except nats.errors.TimeoutError:
            return time.monotonic() - began, None
        return time.monotonic() - began, reply

    for _ in range(2):  # the second round starts after the inbox had nothing waiting
        results = await asyncio.wait_for(
            asyncio.gather(timed("rq.held", 0.1), timed("rq.held", 0.4), timed("rq.later", 5)),
            10,
        )
        (short_s, short), (long_s, long), (_, answered) = results
        assert short is None
        assert long is None
        # Never early; each at its own time (the short one well before the long one).
        assert short_s >= 0.1
        assert long_s >= 0.4
        assert long_s - short_s > 0.15, (short_s, long_s)
        assert long_s < 3
        assert answered is not None
        assert answered.data == b"ok"
        await asyncio.sleep(0.1)  # idle: nothing waits for a while


async def test_the_wal_counts_its_requests_and_leaves_the_client_alone(
    config: BufferedStoreConfig,
) -> None:
    """Every JetStream request nats-py makes for the WAL is counted (and recorded when
    asked), through the view of the connection its JetStream context was given: the
    client's own `request` is never replaced."""
    wal = await NatsWal.connect(config)
    try:
        client = wal._nc
        assert "request" not in vars(client)
        recorded = wal.record_requests()
        before = wal.requests
        await wal.last_seq()
        assert wal.requests - before == 1
        assert recorded == [f"$JS.API.STREAM.INFO.{config.stream_name}"]
        await wal.publish(
            f"{config.stream_name}.t.x", b"e", msg_id="c1", expected_last_subject_seq=0
        )
        assert wal.requests - before == 2  # the write path's own inbox counts too
    finally:
        await wal.close()


async def test_opening_objects_that_do_not_exist_names_them_with_their_own_error(
    make_config: ConfigFactory, nc: Client
) -> None:
    """What `bufstore status` and `health` open without creating: a missing stream or
    bucket is `WalObjectMissingError` (a caller can tell it from a refusal)."""
    config = make_config()
    with pytest.raises(WalObjectMissingError, match=f"the stream {config.stream_name!r}"):
        await NatsWal.connect(config, setup="open")
    await (await NatsWal.connect(config)).close()  # creates every object
    await nc.jetstream().delete_key_value(config.quarantine_bucket)
    wal = await NatsWal.connect(config, setup="open")
    try:
        with pytest.raises(WalObjectMissingError, match=config.quarantine_bucket):
            _ = wal.quarantine
    finally:
        await wal.close()


async def test_the_wals_jetstream_requests_are_answered_on_its_own_inbox(
    config: BufferedStoreConfig,
) -> None:
    """Set-up, direct gets, KV reads and API calls all go through the write path's reply
    inbox (the reply handed over where the client reads it): nats-py's own request path
    (a subscription callback task per reply, `asyncio.wait_for` per request, about 40%
    more client CPU per direct get) is never set up."""
    wal = await NatsWal.connect(config)
    try:
        subject = f"{config.stream_name}.t.x"
        seq, _ = await wal.publish(subject, b"e", msg_id="i1", expected_last_subject_seq=0)
        await wal.kv_swap(hot_key("x"), b"h", revision=None)
        before = wal.requests
        assert (await wal.kv_get(hot_key("x"))) is not None
        last = await wal.last_on(subject)
        assert last is not None
        assert (last.seq, last.data) == (seq, b"e")
        assert (await wal.get(seq)) == last
        assert (await wal.next_on(subject, 1)) == last
        assert await wal.get(seq + 100) is None  # "not found" as before
        await wal.last_seq()
        assert wal.requests - before == 6
        assert wal._nc._resp_sub_prefix is None, "nats-py's request path was used"
    finally:
        await wal.close()
