"""Consumer scans: a range of a stream's messages through a short-lived ephemeral
consumer, delivered in batches into one inbox (a round trip per batch instead of one
direct get per message). Used for the WAL's ranges and the hot bucket's scans.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable
from typing import Any

import nats.errors
import nats.js.errors as jse
import orjson
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DEFAULT_PREFIX, AckPolicy, ConsumerConfig, DeliverPolicy, Header

from buffered_store.backoff import Backoff
from buffered_store.engine.ports import StoredMsg
from buffered_store.errors import WalUnavailableError
from buffered_store.nats.errors import NO_RESPONDERS_FIRST_WAIT_S, NO_RESPONDERS_MAX_WAIT_S

SCAN_BATCH = 2048
"""Messages per pull request of a scan's consumer."""
_NOTHING_MORE = frozenset({"404", "408"})
"""Statuses that end a `no_wait` pull request normally: no message (left) to deliver."""
SCAN_CONSUMER_IDLE_S = 30.0
"""The server deletes a scan's consumer left behind (its scanner died) after this long."""
LEADER_GETS_MAX = 64
"""Past this many messages missing from a scan whose reads must come from the leader (its
consumer's replica far behind, catching up after a restart, say), the scan runs once more
for them before the rest is read one leader get per message."""


async def scan_by_consumer(
    js: JetStreamContext,
    nc: Client,
    stream: str,
    subject: str | None,
    from_seq: int,
    head: str,
    *,
    last: int = 0,
    times: dict[int, float] | None = None,
    timeout_s: float,
    leader: bool = False,
) -> list[StoredMsg]:
    """The messages on `subject` (None: all) from `from_seq` to `last` (0: the
    stream's end), through an ephemeral in-memory consumer (deleted after; the server
    drops it by itself if this process dies first). `timeout_s`: the longest wait for
    one batch.

    `leader`: the scan must hold everything the stream's leader had when it ended (reads
    where `read_from` asks for the leader). The server places a scan's consumer on any
    of a replicated stream's peers (measured on a three-node cluster: a third of them on
    the leader), and a follower may not have applied the newest writes yet. So the
    scan's end is checked with the leader (`last`, or one get of the leader's last
    message on `subject` when `last` is 0), and what the scan did not deliver up to it
    is read from the leader: one get per message (none when the replica was current; a
    second scan first when more than `LEADER_GETS_MAX` are missing)."""

    def scan(start: int, end: int) -> Awaitable[tuple[list[StoredMsg], int]]:
        wanted = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        return _scan(
            js, nc, stream, subject, wanted, head, start, end, times, timeout_s, until_empty=False
        )

    found, seen = await scan(from_seq, last)
    if not leader:
        return found
    end = last or await _leader_last(js, stream, subject)
    if end - seen > LEADER_GETS_MAX:
        more, seen = await scan(seen + 1, end)
        found.extend(more)
    if seen < end:
        found.extend(await _from_leader(js, stream, subject, seen + 1, end, head))
    return found


async def _leader_last(js: JetStreamContext, stream: str, subject: str | None) -> int:
    """The stream seq of the leader's last message on `subject` (None: any), 0: none."""
    try:
        raw = await js.get_last_msg(stream, subject or ">", direct=False)
    except jse.NotFoundError:
        return 0
    return int(raw.seq or 0)


async def _from_leader(
    js: JetStreamContext,
    stream: str,
    subject: str | None,
    from_seq: int,
    last: int,
    head: str,
    *,
    markers: bool = False,
) -> list[StoredMsg]:
    """The messages on `subject` (None: all) from `from_seq` to `last` with a value
    (`markers`: those without one too), as the stream's leader has them: one get per
    message (and one finding none when the range ends with deleted ones)."""
    found: list[StoredMsg] = []
    seq = from_seq
    while seq <= last:
        try:
            raw = await js.get_msg(stream, seq=seq, subject=subject or ">", next=True)
        except jse.NotFoundError:
            break
        msg = stored_msg(raw)
        if msg.seq > last:
            break
        if msg.data or markers:
            found.append(StoredMsg(msg.seq, msg.subject[len(head) :], msg.data))
        seq = msg.seq + 1
    return found


async def live_keys(
    js: JetStreamContext,
    nc: Client,
    stream: str,
    head: str,
    *,
    timeout_s: float,
    leader: bool = False,
) -> list[str]:
    """The keys of a KV bucket (its stream `stream`, key subjects under `head`) whose
    latest message holds a value, in stream order: a last-per-subject consumer drained
    until a pull request of the server's says nothing is left.

    Not nats-py's ``KeyValue.keys``: its watcher decides that the listing is complete
    from a consumer-info answer compared with what its callback has seen so far, so a
    delivery still on its way counts as absent, and under a busy event loop a bucket
    with keys lists none (nats.py issue 842). Here only the server ends a listing.
    Delete and purge markers hold no value, nor does a key written with an empty one:
    neither is listed.

    `leader`: as `scan_by_consumer`'s. Every message after the last one the consumer
    delivered is one its replica had not applied (had it, the message would be the last
    of its key and delivered), so the leader's messages after it, up to its last one
    when the scan ended, update the listing.
    """
    wanted = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
    found, seen = await _scan(
        js, nc, stream, f"{head}>", wanted, head, 1, 0, None, timeout_s, until_empty=True
    )
    keys = dict.fromkeys(m.subject for m in found)
    end = await _leader_last(js, stream, f"{head}>") if leader else 0
    if seen < end:
        for msg in await _from_leader(js, stream, f"{head}>", seen + 1, end, head, markers=True):
            keys.pop(msg.subject, None)
            if msg.data:
                keys[msg.subject] = None
    return list(keys)


async def _scan(
    js: JetStreamContext,
    nc: Client,
    stream: str,
    subject: str | None,
    wanted: ConsumerConfig,
    head: str,
    from_seq: int,
    last: int,
    times: dict[int, float] | None,
    timeout_s: float,
    *,
    until_empty: bool,
) -> tuple[list[StoredMsg], int]:
    """`wanted`'s delivery through an ephemeral ack-less consumer, drained by `_pull_all`,
    and the stream seq of the last message it delivered (`from_seq` - 1: none)."""
    wanted.filter_subject = subject
    wanted.ack_policy = AckPolicy.NONE
    wanted.mem_storage = True
    wanted.num_replicas = 1
    wanted.inactive_threshold = SCAN_CONSUMER_IDLE_S
    info = await js.add_consumer(stream, wanted)
    assert info.name is not None
    try:
        if not info.num_pending:
            return [], from_seq - 1
        return await _pull_all(
            nc, stream, info.name, from_seq, head, last, times, timeout_s, until_empty
        )
    finally:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await js.delete_consumer(stream, info.name)


async def _pull_all(
    nc: Client,
    stream: str,
    consumer: str,
    from_seq: int,
    head: str,
    last: int,
    times: dict[int, float] | None,
    timeout_s: float,
    until_empty: bool,
) -> tuple[list[StoredMsg], int]:
    """Drain an ack-less consumer through one inbox: pull requests of `SCAN_BATCH`
    answered into a subscription callback, no per-message waiting (a quarter of the
    client CPU of `fetch`). Stops at `last` (0: where the stream ended when the
    consumer was made); with `until_empty`, only when a request finds nothing left,
    never on a message's own count of what follows it (which a write landing meanwhile
    can make zero too early)."""
    found: list[StoredMsg] = []
    seq = from_seq - 1
    done = False
    batch_over = asyncio.Event()
    received = 0
    refused = ""
    unheard = False

    async def on_msg(msg: Msg) -> None:
        nonlocal seq, done, received, refused, unheard
        headers = msg.headers or {}
        status = headers.get(Header.STATUS.value)
        if status:
            if status == NO_RESPONDERS_STATUS and not received:
                # Nobody received it: on a cluster, right after a consumer is made, the
                # node this client talks to may not know yet where it lives (2 to 4% of
                # scans through a follower). The same request goes again, after the
                # waits of any request nobody received (`NO_RESPONDERS_FIRST_WAIT_S`).
                unheard = True
            else:
                if status not in _NOTHING_MORE:  # e.g. 409: the consumer went away
                    refused = f"{status} {headers.get(Header.DESCRIPTION.value, '')}"
                done = True
            batch_over.set()
            return
        counters = None if times is not None else ack_counters(msg.reply)
        if counters is None:
            meta = msg.metadata
            counters = meta.sequence.stream, meta.num_pending
            if times is not None:
                times[counters[0]] = meta.timestamp.timestamp()
        received += 1
        seq, pending = counters
        if last and seq > last:
            done = True
        elif msg.data:
            found.append(StoredMsg(seq, msg.subject[len(head) :], msg.data))
        if (pending == 0 and not until_empty) or (last and seq >= last):
            done = True
        if done or received >= wanted:
            batch_over.set()

    subject = f"{DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
    wanted = 0
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=0, pending_bytes_limit=0)
    loop = asyncio.get_running_loop()
    retry = Backoff(NO_RESPONDERS_FIRST_WAIT_S, NO_RESPONDERS_MAX_WAIT_S, budget_s=timeout_s)
    try:
        while not done:
            # Never ask for more than the range holds: no batch overshoots it.
            wanted = SCAN_BATCH if not last else max(1, min(SCAN_BATCH, last - seq))
            received = 0
            unheard = False
            batch_over.clear()
            request = orjson.dumps({"batch": wanted, "no_wait": True})
            await nc.publish(subject, request, reply=inbox)
            try:
                await asyncio.wait_for(batch_over.wait(), timeout_s)
            except TimeoutError:
                if not received:
                    break  # the last pending ones were superseded meanwhile
                # A slow batch: ask again for what is still missing.
            if unheard:
                wait = retry.next_wait(loop.time())
                if wait is None:
                    refused = (
                        f"{NO_RESPONDERS_STATUS} no responders for {consumer} within {timeout_s} s"
                    )
                    break
                await asyncio.sleep(wait)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    if refused:  # never a silently shortened scan
        raise WalUnavailableError(f"consumer scan of {stream} interrupted: {refused.strip()}")
    return found, seq


_ACK_V1_TOKENS = 9
"""``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>``"""


def ack_counters(reply: str | None) -> tuple[int, int] | None:
    """``(stream seq, pending)`` of a delivered JetStream message, from its reply subject
    (None: not one nats-py would take apart either).

    What ``msg.metadata`` gives, without its objects and timestamp: a consumer scan of
    10,000 entries made them for every message.
    """
    fields = ack_fields(reply)
    return None if fields is None else (fields[0], fields[2])


def ack_fields(reply: str | None) -> tuple[int, int, int] | None:
    """``(stream seq, times delivered, pending)`` of a delivered JetStream message, from
    its reply subject (None: not one nats-py would take apart either), as
    ``msg.metadata`` has them: what a consumer's reader needs of every message."""
    if not reply:
        return None
    tokens = reply.split(".")
    if len(tokens) < _ACK_V1_TOKENS or tokens[0] != "$JS" or tokens[1] != "ACK":
        return None
    try:
        if len(tokens) == _ACK_V1_TOKENS:
            return int(tokens[5]), int(tokens[4]), int(tokens[8])
        if len(tokens) >= 11:
            return (
                int(tokens[Msg.Ack.StreamSeq]),
                int(tokens[Msg.Ack.NumDelivered]),
                int(tokens[Msg.Ack.NumPending]),
            )
    except ValueError:
        return None
    return None


_SPACE = re.compile(r"\s")


def header_lines(raw: bytes) -> dict[str, str]:
    """nats-py's ``Client._parse_header_lines``, the same result at a third of the cost:
    a name with whitespace is skipped by one regular-expression search instead of a
    Python generator over its characters, which made about a fifth of receiving a
    consumer scan."""
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if _SPACE.search(key):
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def parse_headers_faster(nc: Client) -> None:
    """Make `nc` parse message headers with `header_lines` (a connection that receives
    many messages: a scan of the WAL tail). Nothing changes if nats-py no longer has the
    hook."""
    if callable(getattr(nc, "_parse_header_lines", None)):
        nc._parse_header_lines = header_lines  # type: ignore[method-assign]


def stored_msg(raw: Any) -> StoredMsg:
    """A message nats-py fetched, as the engine's `StoredMsg`."""
    return StoredMsg(seq=int(raw.seq), subject=str(raw.subject), data=bytes(raw.data or b""))
