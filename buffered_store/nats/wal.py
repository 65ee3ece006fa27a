"""The NATS JetStream adapter: the engine's ports (`buffered_store.engine.ports`) on a
stream, two KV buckets and the flusher's durable consumer.

Thin on purpose: it awaits, translates nats errors into our family (`translated`) and
counts requests; deciding what to write is the callers' business. No nats-py object
leaves this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import nats
import nats.errors
import nats.js.errors as jse
import orjson
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    DEFAULT_PREFIX,
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    Header,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE
from nats.js.kv import KeyValue

from buffered_store.backoff import Backoff
from buffered_store.config import EngineConfig
from buffered_store.engine.frontend import FRONT_END_KEY, stream_metadata, tag_of, wrong_front_end
from buffered_store.engine.keys import stream_subjects
from buffered_store.engine.ports import AgedValue, ConsumerState, KvValue, StoredMsg
from buffered_store.errors import (
    ConfigError,
    ConflictError,
    StoreError,
    WalUnavailableError,
)
from buffered_store.nats.connection import Reconnect, open_client
from buffered_store.nats.delivery import NatsDelivery
from buffered_store.nats.errors import WRONG_LAST_SEQUENCE, translated

log = logging.getLogger("buffered_store.nats.wal")
T = TypeVar("T")

SCAN_DIRECT_GETS = 8
"""Hot records a scan reads with direct gets before it sets up a consumer for the rest."""
SCAN_BATCH = 2048
"""Messages per pull request of a scan's consumer."""
_NOTHING_MORE = frozenset({"404", "408"})
"""Statuses that end a `no_wait` pull request normally: no message (left) to deliver."""
SCAN_CONSUMER_IDLE_S = 30.0
"""The server deletes a scan's consumer left behind (its scanner died) after this long."""

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
MSG_ID = "Nats-Msg-Id"
KV_WRONG_LAST = (WRONG_LAST_SEQUENCE, 10164)
"""Error codes of a KV compare-and-set that found another revision (as `KeyValue.update`)."""
NO_RESPONDERS_FIRST_WAIT_S = 0.005
NO_RESPONDERS_MAX_WAIT_S = 0.1
"""A request that found nobody listening is sent again after these waits (doubling)."""


async def until_answered(send: Callable[[float], Awaitable[Msg]], budget_s: float) -> Msg:
    """The reply `send(timeout_s)` gets, sending again while the server answers "no
    responders", all within `budget_s` seconds (then `NoRespondersError`): each send is
    given only the time left.

    Nobody received such a request, so sending it again cannot store anything twice. On a
    cluster a stream or bucket that was just created answers this way until the node the
    client talks to has learnt where it lives, and a replicated one while it elects a
    leader: a short wait turns those moments into a slower call instead of a failure.
    """
    loop = asyncio.get_running_loop()
    retry = Backoff(NO_RESPONDERS_FIRST_WAIT_S, NO_RESPONDERS_MAX_WAIT_S, budget_s=budget_s)
    left = retry.left(loop.time())
    while True:
        try:
            return await send(left)
        except nats.errors.NoRespondersError:
            wait = retry.next_wait(loop.time())
            if wait is None:
                raise
        await asyncio.sleep(wait)
        left = max(retry.left(loop.time()), NO_RESPONDERS_FIRST_WAIT_S)


def may_appear(subject: str) -> bool:
    """Whether "no responders" on `subject` can be a moment's state worth waiting out: a
    stream's or bucket's subjects and its direct gets, yes; the rest of the JetStream API
    (`$JS.API.`) is answered by every server with JetStream enabled, so there it means
    JetStream is off, and the call fails at once."""
    return not subject.startswith("$JS.API.") or subject.startswith("$JS.API.DIRECT.GET.")


class ReplyInbox:
    """Request/reply for the write path's two round trips, on one wildcard inbox.

    `Client.request` does the same, but waits for each reply through
    `asyncio.wait_for`, about a fifth of a checkpoint's client CPU; here the wait is a
    future under `asyncio.timeout`. The subscription is made on first use and, like any
    subscription, renewed by nats-py after a reconnect.
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox() + "."
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count()
        self._subscribed: asyncio.Future[Any] | None = None

    async def request(
        self, subject: str, payload: bytes, headers: dict[str, str], *, timeout_s: float
    ) -> Msg:
        """The reply to one request; nats-py's errors on failure (`TimeoutError` and
        `NoRespondersError` included), as `Client.request` raises them."""
        await self._subscribe()
        token = str(next(self._tokens))
        reply: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[token] = reply
        try:
            await self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
            try:
                async with asyncio.timeout(timeout_s):
                    msg = await reply
            except TimeoutError:
                raise nats.errors.TimeoutError from None
        finally:
            self._waiting.pop(token, None)
        if msg.headers and msg.headers.get(Header.STATUS) == NO_RESPONDERS_STATUS:
            raise nats.errors.NoRespondersError
        return msg

    async def _subscribe(self) -> None:
        if self._subscribed is None:
            self._subscribed = asyncio.ensure_future(
                self._nc.subscribe(self._prefix + "*", cb=self._deliver)
            )
        if self._subscribed.done() and self._subscribed.exception() is None:
            return
        try:
            await asyncio.shield(self._subscribed)
        except BaseException:
            if self._subscribed.done():
                self._subscribed = None  # failed: the next request subscribes again
            raise

    async def _deliver(self, msg: Msg) -> None:
        reply = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if reply is not None and not reply.done():
            reply.set_result(msg)


class NatsWal:
    """One NATS connection with the project's JetStream objects (the `engine.ports.Wal`)."""

    def __init__(self, nc: Client, config: EngineConfig, *, front_end: str | None = None) -> None:
        self._nc = nc
        self.config = config
        self.front_end = front_end
        """The front-end this connection writes or drains for (None: any): a stream it
        creates is tagged with it, and a stream tagged for another is refused."""
        self.stream_front_end: str | None = None
        """The front-end the stream's metadata names, once opened (None: untagged)."""
        self._js: JetStreamContext = nc.jetstream(timeout=config.request_timeout_s)
        self.stream = config.stream_name
        self.direct = not config.leader_reads
        """Reads use direct gets (any replica answers) rather than the stream leader.

        Direct gets are served by every replica, including one that has not yet applied
        the last acknowledged write, so on a cluster they break read-your-writes and
        can hand the writer a stale cursor; `EngineConfig.read_from` decides.
        """
        self.requests = 0
        """Requests sent to the server so far (each is one round trip)."""
        self._hot: KeyValue | None = None
        self._hot_prefix = f"$KV.{config.hot_bucket}."
        """Subject prefix of the hot bucket's keys (no JetStream domain is used)."""
        self._quarantine: NatsBucket | None = None
        self._replies = ReplyInbox(nc)
        self._recorded: list[str] | None = None
        self._count_requests()

    def record_requests(self) -> list[str]:
        """From now on, append the subject of every request made through the
        connection's request path (JetStream API calls, direct gets, KV reads) to the
        returned list: what a test looking at where reads go needs."""
        self._recorded = []
        return self._recorded

    def _count_requests(self) -> None:
        # Every JetStream call (publish, direct get, KV update) is one nc.request: counting
        # here measures round trips without touching the callers, and sending again a
        # request nobody listened to (`until_answered`, where `may_appear`) covers them
        # all. (The flusher's pull fetches are publishes, not requests: not retried.)
        original: Callable[..., Awaitable[Msg]] = self._nc.request
        default_budget_s = self.config.request_timeout_s

        async def counting_request(subject: str, *args: Any, **kwargs: Any) -> Msg:
            async def send(timeout_s: float) -> Msg:
                self.requests += 1
                if self._recorded is not None:
                    self._recorded.append(subject)
                return await original(subject, *args, **{**kwargs, "timeout": timeout_s})

            budget_s = kwargs.get("timeout") or default_budget_s
            if not may_appear(subject):
                return await send(budget_s)
            return await until_answered(send, budget_s)

        self._nc.request = counting_request  # type: ignore[method-assign]

    @classmethod
    async def connect(
        cls,
        config: EngineConfig,
        *,
        name: str = "bufstore",
        setup: Literal["ensure", "open", "none"] = "ensure",
        reconnect: Reconnect = "forever",
        connect_timeout_s: float | None = None,
        front_end: str | None = None,
        confirm_stream: Callable[[NatsWal], Awaitable[None]] | None = None,
    ) -> NatsWal:
        """Connect and open the JetStream objects.

        ``setup``: ``"ensure"`` (default) creates whatever object is missing; ``"open"``
        opens existing ones (`StoreError` naming a missing stream, consumer or hot
        bucket); ``"none"`` touches no server object, for handles that only read the
        stream.

        The first connection must stand within `connect_timeout_s` (default
        ``config.connect_timeout_s``; `WalUnavailableError` naming the server after it);
        refused credentials or TLS raise `WalAccessDeniedError` at once. ``reconnect``:
        ``"forever"`` (default: stores and flushers) reconnects after any later loss;
        ``"never"`` gives up on a lost connection (Spark tasks); ``"probe"`` too, tries
        each server once, without retries, and logs nothing (a one-shot health check).
        See `connection.open_client`.

        ``front_end`` (``"threadrun"``, ``"langgraph"``): a stream created here is tagged
        with it (stream metadata), and a stream tagged for another front-end is refused
        with `ConfigError` (see `buffered_store.engine.frontend`). ``confirm_stream``
        runs right after the stream is opened, before anything else is created (a
        flusher judges an untagged stream there).
        """
        nc = await open_client(config, name=name, reconnect=reconnect, timeout_s=connect_timeout_s)
        wal = cls(nc, config, front_end=front_end)
        try:
            if setup == "ensure":
                await wal.ensure_objects(confirm_stream)
            elif setup == "open":
                await wal.open_objects()
        except BaseException:
            await nc.close()
            raise
        return wal

    async def close(self, *, drain: bool = True) -> None:
        """Flush pending writes (unless `drain` is False) and close the connection."""
        if not self._nc.is_closed:
            if not drain:
                await self._nc.close()
                return
            try:
                await asyncio.wait_for(self._nc.drain(), timeout=self.config.request_timeout_s)
            except Exception:  # closing anyway; nothing is pending that matters
                await self._nc.close()

    @property
    def max_payload(self) -> int:
        """Largest message the server accepts (1 MiB before the connection says)."""
        return int(getattr(self._nc, "max_payload", 0) or 1024 * 1024)

    @property
    def reconnects(self) -> int:
        """Times the client re-established its connection."""
        return int(self._nc.stats.get("reconnects", 0))

    # -- set-up -------------------------------------------------------------------------

    def _stream_config(self) -> StreamConfig:
        """The WAL stream as the configuration asks for it."""
        cfg = self.config
        return StreamConfig(
            name=self.stream,
            subjects=[stream_subjects(self.stream)],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=cfg.max_age_s or 0.0,
            max_bytes=cfg.wal_max_bytes or -1,
            duplicate_window=cfg.duplicate_window_s,
            num_replicas=cfg.replicas,
            allow_direct=True,
            # At `max_bytes` the server refuses new entries (`WalFullError`) instead of
            # dropping the oldest, which may be unflushed.
            discard=DiscardPolicy.NEW if cfg.wal_max_bytes else DiscardPolicy.OLD,
            metadata=stream_metadata(self.front_end),
        )

    def _consumer_config(self) -> ConsumerConfig:
        """The durable flusher consumer as the configuration asks for it."""
        cfg = self.config
        return ConsumerConfig(
            durable_name=cfg.consumer_name,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=cfg.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=cfg.max_ack_pending,
            filter_subject=stream_subjects(self.stream),
            max_waiting=512,
        )

    async def ensure_objects(
        self, confirm_stream: Callable[[NatsWal], Awaitable[None]] | None = None
    ) -> None:
        """Create the stream, buckets and consumer, or check the existing ones agree
        (`confirm_stream`, if given, runs once the stream is there, before the rest)."""
        async with translated("set up JetStream"):
            await self._ensure_stream()
            if confirm_stream is not None:
                await confirm_stream(self)
            self._hot = await self._ensure_bucket(self.config.hot_bucket, history=1)
            quarantine = await self._ensure_bucket(self.config.quarantine_bucket, history=1)
            self._quarantine = NatsBucket(quarantine, "quarantine bucket")
            await self._ensure_consumer()

    async def open_objects(self) -> None:
        """Open the stream, the consumer and the hot bucket, which must exist (`StoreError`
        naming the missing one), and the quarantine bucket if it exists."""
        cfg = self.config
        async with translated("open JetStream objects"):
            try:
                self._check_front_end((await self._js.stream_info(cfg.stream_name)).config)
            except jse.NotFoundError:
                raise StoreError(
                    f"the stream {cfg.stream_name!r} does not exist (check the stream name: "
                    "BUFSTORE_STREAM_NAME; only a store or a flusher creates it)"
                ) from None
            try:
                await self._js.consumer_info(cfg.stream_name, cfg.consumer_name)
            except jse.NotFoundError:
                raise StoreError(
                    f"the consumer {cfg.consumer_name!r} does not exist on the stream "
                    f"{cfg.stream_name!r} (check BUFSTORE_CONSUMER_NAME)"
                ) from None
            try:
                hot = await self._js.key_value(cfg.hot_bucket)
            except (jse.BucketNotFoundError, jse.NotFoundError):
                raise StoreError(
                    f"the bucket {cfg.hot_bucket!r} does not exist (check BUFSTORE_HOT_BUCKET)"
                ) from None
            self._hot = self._bucket_handle(hot, cfg.hot_bucket)
            with contextlib.suppress(jse.BucketNotFoundError, jse.NotFoundError):
                quarantine = await self._js.key_value(cfg.quarantine_bucket)
                self._quarantine = NatsBucket(
                    self._bucket_handle(quarantine, cfg.quarantine_bucket), "quarantine bucket"
                )

    async def _ensure_stream(self) -> None:
        wanted = self._stream_config()
        try:
            info = await self._js.stream_info(self.stream)
        except jse.NotFoundError:
            created = await self._js.add_stream(wanted)
            self.stream_front_end = tag_of(created.config.metadata)
            return
        have = info.config
        self._check_front_end(have)
        conflicts = [
            f"{name}: existing {old!r}, configured {new!r}"
            for name, old, new in (
                ("subjects", have.subjects, wanted.subjects),
                ("retention", have.retention, wanted.retention),
                ("storage", have.storage, wanted.storage),
                ("num_replicas", have.num_replicas, wanted.num_replicas),
                ("max_age", have.max_age or 0.0, wanted.max_age),
                ("max_bytes", _unlimited(have.max_bytes), _unlimited(wanted.max_bytes)),
                ("discard", _discard(have), _discard(wanted)),
                ("duplicate_window", have.duplicate_window, wanted.duplicate_window),
                ("allow_direct", bool(have.allow_direct), True),
            )
            if old != new
        ]
        if conflicts:
            raise ConfigError(
                f"stream {self.stream!r} exists with a different configuration ("
                + "; ".join(conflicts)
                + "). Change the configuration to match, or update the stream deliberately "
                "(e.g. `nats stream edit " + self.stream + " --max-age 0` after an upgrade "
                "from a version whose max_age_s was 7 days; see docs/operations.md)."
            )

    def _check_front_end(self, have: StreamConfig) -> None:
        """Note whose the stream is; `ConfigError` when it is another front-end's."""
        self.stream_front_end = tag_of(have.metadata)
        found, ours = self.stream_front_end, self.front_end
        if found and ours and found != ours:
            evidence = f"its metadata {FRONT_END_KEY}={found!r}"
            raise ConfigError(wrong_front_end(self.stream, found, ours, evidence))

    async def tag_stream(self) -> bool:
        """Tag an untagged stream with this connection's front-end (stream metadata);
        False when the server keeps no metadata (before 2.10) or the stream is tagged."""
        if self.front_end is None:
            return False
        async with translated("tag the stream"):
            have = (await self._js.stream_info(self.stream)).config
            if tag_of(have.metadata) is not None:
                self.stream_front_end = tag_of(have.metadata)
                return False
            have.metadata = {**(have.metadata or {}), **(stream_metadata(self.front_end) or {})}
            updated = await self._js.update_stream(have)
        self.stream_front_end = tag_of(updated.config.metadata)
        return self.stream_front_end == self.front_end

    async def _ensure_bucket(self, bucket: str, *, history: int) -> KeyValue:
        return self._bucket_handle(await self._open_bucket(bucket, history=history), bucket)

    def _bucket_handle(self, kv: KeyValue, bucket: str) -> KeyValue:
        if self.direct:
            return kv
        # nats-py's KeyValue reads with direct gets whenever the bucket allows them (and
        # ours do, for the single-server fast path); a handle built with direct=False
        # sends its gets to the bucket's stream leader instead. Writes are unaffected.
        return KeyValue(
            name=bucket,
            stream=KV_STREAM_TEMPLATE.format(bucket=bucket),
            pre=KV_PRE_TEMPLATE.format(bucket=bucket),
            js=self._js,
            direct=False,
        )

    async def _open_bucket(self, bucket: str, *, history: int) -> KeyValue:
        try:
            return await self._js.key_value(bucket)
        except (jse.BucketNotFoundError, jse.NotFoundError):
            return await self._js.create_key_value(
                KeyValueConfig(
                    bucket=bucket,
                    history=history,
                    storage=StorageType.FILE,
                    replicas=self.config.replicas,
                    direct=True,
                )
            )

    async def ensure_consumer(self) -> bool:
        """Create the flusher consumer if it is missing (e.g. deleted by an operator);
        True when it had to be created."""
        async with translated("re-create the flusher consumer"):
            try:
                await self._js.consumer_info(self.stream, self.config.consumer_name)
                return False
            except jse.NotFoundError:
                await self._ensure_consumer()
                return True

    async def _ensure_consumer(self) -> None:
        wanted = self._consumer_config()
        try:
            info = await self._js.consumer_info(self.stream, self.config.consumer_name)
        except jse.NotFoundError:
            try:
                await self._js.add_consumer(self.stream, wanted)
            except jse.BadRequestError:
                # Created concurrently by another process with the same config: fine.
                await self._js.consumer_info(self.stream, self.config.consumer_name)
            return
        have = info.config
        conflicts = [
            f"{name}: existing {old!r}, configured {new!r}"
            for name, old, new in (
                ("ack_policy", have.ack_policy, wanted.ack_policy),
                ("ack_wait", have.ack_wait, wanted.ack_wait),
                ("filter_subject", have.filter_subject, wanted.filter_subject),
                ("deliver_policy", have.deliver_policy, wanted.deliver_policy),
            )
            if old != new
        ]
        if conflicts:
            raise ConfigError(
                f"consumer {self.config.consumer_name!r} exists with a different configuration ("
                + "; ".join(conflicts)
                + ")."
            )

    @property
    def _hot_kv(self) -> KeyValue:
        """The hot metadata bucket."""
        assert self._hot is not None, "ensure_objects() first"
        return self._hot

    @property
    def quarantine(self) -> NatsBucket:
        """The quarantine bucket (`StoreError` when it was not found on opening)."""
        if self._quarantine is None:
            raise StoreError(f"the bucket {self.config.quarantine_bucket!r} was not found")
        return self._quarantine

    # -- stream -------------------------------------------------------------------------

    async def publish(
        self, subject: str, payload: bytes, *, msg_id: str, expected_last_subject_seq: int
    ) -> tuple[int, bool]:
        """Append with a per-subject compare-and-set; returns (stream seq, duplicate).

        Raises `ConflictError` when another entry is now the last one on the subject.
        """
        headers = {MSG_ID: msg_id, EXPECTED_LAST_SUBJECT_SEQ: str(expected_last_subject_seq)}
        async with translated(f"publish {subject}"):
            return await self._js_publish(subject, payload, headers)

    async def _js_publish(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, bool]:
        """`JetStreamContext.publish` on the hot path, minus its layers: one request on
        the connection's reply inbox and the ack parsed with orjson. Errors are nats-py's
        own, for `translated`."""
        timeout_s = self.config.request_timeout_s

        async def send(left_s: float) -> Msg:
            self.requests += 1
            return await self._replies.request(subject, payload, headers, timeout_s=left_s)

        try:
            msg = await until_answered(send, timeout_s)
        except nats.errors.NoRespondersError:
            raise jse.NoStreamResponseError from None
        ack = orjson.loads(msg.data)
        error = ack.get("error")
        if error is not None:
            raise jse.APIError.from_error(error)
        return int(ack["seq"]), bool(ack.get("duplicate"))

    async def get(self, seq: int) -> StoredMsg | None:
        """The message at a stream seq, or None when absent."""
        async with translated(f"get message {seq}"):
            try:
                raw = await self._js.get_msg(self.stream, seq=seq, direct=self.direct)
            except jse.NotFoundError:
                return None
        return _stored(raw)

    async def last_on(self, subject: str) -> StoredMsg | None:
        """The last message on a subject, or None."""
        async with translated(f"get last message of {subject}"):
            try:
                raw = await self._js.get_last_msg(self.stream, subject, direct=self.direct)
            except jse.NotFoundError:
                return None
        return _stored(raw)

    async def next_on(self, subject: str, from_seq: int) -> StoredMsg | None:
        """The first message on a subject at or after a stream seq, or None."""
        async with translated(f"get next message of {subject}"):
            try:
                raw = await self._js.get_msg(
                    self.stream,
                    seq=max(1, from_seq),
                    subject=subject,
                    next=True,
                    direct=self.direct,
                )
            except jse.NotFoundError:
                return None
        return _stored(raw)

    async def hot_updates(self, prefix: str, from_seq: int) -> list[StoredMsg]:
        """Messages of the hot bucket's stream on keys starting with `prefix`, from
        `from_seq` on (each key appears once: the bucket keeps only its latest value).

        `StoredMsg.subject` is the key. The first `SCAN_DIRECT_GETS` come from direct gets
        (one round trip each, nothing to set up); a longer scan continues through a
        short-lived consumer that delivers the rest in batches (served by the stream
        leader, so it reads what leader reads would).
        """
        stream = f"KV_{self.config.hot_bucket}"
        head = f"$KV.{self.config.hot_bucket}."
        subject = f"{head}{prefix}>"
        found: list[StoredMsg] = []
        seq = max(1, from_seq)
        async with translated(f"scan hot records from {seq}"):
            for _ in range(SCAN_DIRECT_GETS):
                try:
                    raw = await self._js.get_msg(
                        stream, seq=seq, subject=subject, next=True, direct=self.direct
                    )
                except jse.NotFoundError:
                    return found
                msg = _stored(raw)
                if msg.data:  # a delete or purge marker has no value
                    found.append(StoredMsg(msg.seq, msg.subject[len(head) :], msg.data))
                seq = msg.seq + 1
            found.extend(await self._scan_by_consumer(stream, subject, seq, head))
        return found

    async def read_range(self, first: int, last: int) -> list[StoredMsg]:
        """The WAL's messages with stream seq in ``[first, last]``, in stream order.

        One short-lived consumer delivers them in batches of `SCAN_BATCH`: a round trip
        per batch instead of one direct get per message.
        """
        if last < first:
            return []
        async with translated(f"read WAL messages {first}..{last}"):
            return await self._scan_by_consumer(self.stream, None, max(1, first), "", last=last)

    async def hot_oldest(self, prefix: str, limit: int) -> list[AgedValue]:
        """The least recently written live hot keys under `prefix`: those among the
        bucket stream's first `limit` seqs (one consumer delivering them in a batch)."""
        stream = f"KV_{self.config.hot_bucket}"
        head = self._hot_prefix
        async with translated("scan the oldest hot records"):
            info = await self._js.stream_info(stream)
            first = max(1, int(info.state.first_seq or 1))
            times: dict[int, float] = {}
            found = await self._scan_by_consumer(
                stream, f"{head}{prefix}>", first, head, last=first + limit - 1, times=times
            )
        return [AgedValue(m.subject, m.data, m.seq, times.get(m.seq, 0.0)) for m in found]

    async def kv_forget(self, key: str, revision: int) -> bool:
        """A purge marker written only if the key is still at `revision` (it removes the
        key's value), then a purge of the bucket stream below it on that subject (it
        removes the marker, and never a later write)."""
        subject = self._hot_prefix + key
        headers = {
            "KV-Operation": "PURGE",
            "Nats-Rollup": "sub",
            EXPECTED_LAST_SUBJECT_SEQ: str(revision),
        }
        async with translated(f"forget {key}"):
            try:
                marker, _ = await self._js_publish(subject, b"", headers)
            except jse.APIError as exc:
                if exc.err_code in KV_WRONG_LAST or "wrong last sequence" in str(exc):
                    return False
                raise
            await self._js.purge_stream(
                f"KV_{self.config.hot_bucket}", seq=marker + 1, subject=subject
            )
        return True

    async def _scan_by_consumer(
        self,
        stream: str,
        subject: str | None,
        from_seq: int,
        head: str,
        *,
        last: int = 0,
        times: dict[int, float] | None = None,
    ) -> list[StoredMsg]:
        """The messages on `subject` (None: all) from `from_seq` to `last` (0: the
        stream's end), through an ephemeral in-memory consumer (deleted after; the server
        drops it by itself if this process dies first)."""
        info = await self._js.add_consumer(
            stream,
            ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=from_seq,
                filter_subject=subject,
                ack_policy=AckPolicy.NONE,
                mem_storage=True,
                num_replicas=1,
                inactive_threshold=SCAN_CONSUMER_IDLE_S,
            ),
        )
        assert info.name is not None
        try:
            if not info.num_pending:
                return []
            return await self._pull_all(stream, info.name, from_seq, head, last, times)
        finally:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await self._js.delete_consumer(stream, info.name)

    async def _pull_all(
        self,
        stream: str,
        consumer: str,
        from_seq: int,
        head: str,
        last: int,
        times: dict[int, float] | None = None,
    ) -> list[StoredMsg]:
        """Drain an ack-less consumer through one inbox: pull requests of `SCAN_BATCH`
        answered into a subscription callback, no per-message waiting (a quarter of the
        client CPU of `fetch`). Stops at `last` (0: where the stream ended when the
        consumer was made)."""
        found: list[StoredMsg] = []
        seq = from_seq - 1
        done = False
        batch_over = asyncio.Event()
        received = 0
        refused = ""

        async def on_msg(msg: Msg) -> None:
            nonlocal seq, done, received, refused
            headers = msg.headers or {}
            status = headers.get(Header.STATUS.value)
            if status:
                if status not in _NOTHING_MORE:  # e.g. 409: the consumer went away
                    refused = f"{status} {headers.get(Header.DESCRIPTION.value, '')}"
                done = True
                batch_over.set()
                return
            meta = msg.metadata
            received += 1
            seq = meta.sequence.stream
            if last and seq > last:
                done = True
            elif msg.data:
                found.append(StoredMsg(seq, msg.subject[len(head) :], msg.data))
                if times is not None:
                    times[seq] = meta.timestamp.timestamp()
            if meta.num_pending == 0 or (last and seq >= last):
                done = True
            if done or received >= wanted:
                batch_over.set()

        subject = f"{DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        wanted = 0
        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(
            inbox, cb=on_msg, pending_msgs_limit=0, pending_bytes_limit=0
        )
        try:
            while not done:
                # Never ask for more than the range holds: no batch overshoots it.
                wanted = SCAN_BATCH if not last else max(1, min(SCAN_BATCH, last - seq))
                received = 0
                batch_over.clear()
                request = orjson.dumps({"batch": wanted, "no_wait": True})
                await self._nc.publish(subject, request, reply=inbox)
                try:
                    await asyncio.wait_for(batch_over.wait(), self.config.request_timeout_s)
                except TimeoutError:
                    if not received:
                        break  # the last pending ones were superseded meanwhile
                    # A slow batch: ask again for what is still missing.
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if refused:  # never a silently shortened scan
            raise WalUnavailableError(f"consumer scan of {stream} interrupted: {refused.strip()}")
        return found

    async def get_many(self, seqs: Sequence[int], *, parallel: int = 64) -> list[StoredMsg]:
        """Messages at several stream seqs (absent ones skipped), fetched concurrently."""
        out: list[StoredMsg] = []
        for start in range(0, len(seqs), parallel):
            chunk = await asyncio.gather(*(self.get(s) for s in seqs[start : start + parallel]))
            out.extend(m for m in chunk if m is not None)
        return out

    async def tail_bounds(self) -> tuple[int, int]:
        """(first unacknowledged stream seq, last stream seq) of the flusher consumer.

        Everything not yet flushed lies in that range; so may some flushed entries acked
        out of order, which readers drop by comparing with the watermarks.
        """
        state = await self.consumer_state()
        return state.ack_floor + 1, state.last_seq

    async def append(self, subject: str, payload: bytes) -> int:
        """Append without any expectation; the stream seq."""
        async with translated(f"publish {subject}"):
            ack = await self._js.publish(subject, payload, stream=self.stream)
        return int(ack.seq)

    async def last_seq(self) -> int:
        """The stream's last seq (0: empty)."""
        async with translated("read the stream state"):
            info = await self._js.stream_info(self.stream)
        return int(info.state.last_seq)

    async def purge_below(self, seq: int) -> None:
        """Remove every message below stream seq `seq` (one purge request)."""
        if seq <= 1:
            return
        async with translated(f"trim the WAL below {seq}"):
            await self._js.purge_stream(self.stream, seq=seq)

    async def consumer_state(self) -> ConsumerState:
        """The durable consumer's counters and the stream's last seq."""
        async with translated("read the flusher consumer"):
            consumer, stream = await asyncio.gather(
                self._js.consumer_info(self.stream, self.config.consumer_name),
                self._js.stream_info(self.stream),
            )
        return ConsumerState(
            num_pending=int(consumer.num_pending or 0),
            num_ack_pending=int(consumer.num_ack_pending or 0),
            num_redelivered=int(consumer.num_redelivered or 0),
            ack_floor=int(consumer.ack_floor.stream_seq or 0) if consumer.ack_floor else 0,
            last_seq=int(stream.state.last_seq),
            messages=int(stream.state.messages),
            first_seq=int(stream.state.first_seq),
            bytes=int(stream.state.bytes),
        )

    async def consumer_activity(self) -> tuple[int, float | None]:
        """(pull requests waiting on the durable consumer, seconds since it last
        delivered a message or had one acknowledged; None: never): whether a flusher
        consumes it, as the server sees it."""
        async with translated("read the flusher consumer"):
            info = await self._js.consumer_info(self.stream, self.config.consumer_name)
        stamps = [
            seq.last_active
            for seq in (info.delivered, info.ack_floor)
            if seq is not None and seq.last_active is not None
        ]
        idle = None
        if stamps:
            now = datetime.now(UTC)
            idle = max(0.0, (now - max(stamps)).total_seconds())
        return int(info.num_waiting or 0), idle

    async def subscribe(self) -> NatsDelivery:
        """A pull subscription bound to the durable consumer."""
        reconnects = self.reconnects
        async with translated("bind to the flusher consumer"):
            return await NatsDelivery.open(
                self._nc,
                self.stream,
                self.config.consumer_name,
                lambda: self.reconnects != reconnects,
            )

    # -- KV -----------------------------------------------------------------------------

    async def kv_get(self, key: str) -> KvValue | None:
        """A key's value and revision, or None when absent or deleted."""
        return await _kv_get(self._hot_kv, key)

    async def kv_get_many(self, keys: Sequence[str]) -> list[KvValue | None]:
        """Several keys concurrently."""
        return list(await asyncio.gather(*(self.kv_get(k) for k in keys)))

    async def kv_swap(self, key: str, value: bytes, *, revision: int | None) -> int:
        """Compare-and-set: write if the key is at `revision` (None: if it is absent).

        Returns the new revision; raises `ConflictError` when the key moved meanwhile.
        """
        async with translated(f"update {key}"):
            try:
                if revision is None:
                    return await self._hot_kv.create(key, value)
                # `KeyValue.update` is this publish with the expected last subject seq.
                headers = {EXPECTED_LAST_SUBJECT_SEQ: str(revision)}
                seq, _ = await self._js_publish(self._hot_prefix + key, value, headers)
                return seq
            except jse.KeyWrongLastSequenceError as exc:
                raise ConflictError(f"update {key}: the key changed meanwhile") from exc
            except jse.APIError as exc:
                if exc.err_code in KV_WRONG_LAST or "wrong last sequence" in str(exc):
                    raise ConflictError(f"update {key}: the key changed meanwhile") from exc
                raise

    async def kv_put(self, key: str, value: bytes) -> int:
        """Unconditional write."""
        async with translated(f"put {key}"):
            return await self._hot_kv.put(key, value)

    async def kv_delete(self, key: str) -> None:
        """Delete a key."""
        async with translated(f"delete {key}"):
            await self._hot_kv.delete(key)


async def _kv_get(kv: KeyValue, key: str) -> KvValue | None:
    async with translated(f"read {key}"):
        try:
            entry = await kv.get(key)
        except (jse.KeyNotFoundError, jse.KeyDeletedError):
            return None
    if entry.value is None or entry.revision is None:
        return None
    return KvValue(entry.value, entry.revision)


class NatsBucket:
    """A JetStream KV bucket as the engine's `Bucket` port."""

    def __init__(self, kv: KeyValue, what: str) -> None:
        self._kv = kv
        self._what = what

    async def get(self, key: str) -> KvValue | None:
        """A key's value and revision, or None when absent or deleted."""
        return await _kv_get(self._kv, key)

    async def create(self, key: str, value: bytes) -> int:
        """Write a key that does not exist; `ConflictError` when it does."""
        async with translated(f"create {key} in the {self._what}"):
            return await self._kv.create(key, value)

    async def swap(self, key: str, value: bytes, *, revision: int | None) -> int:
        """Compare-and-set on the key's revision (None: absent)."""
        if revision is None:
            return await self.create(key, value)
        # `KeyValue.update` raises KeyWrongLastSequenceError (no err_code) on a conflict.
        async with translated(f"update {key} in the {self._what}"):
            return await self._kv.update(key, value, last=revision)

    async def put(self, key: str, value: bytes) -> int:
        """Unconditional write."""
        async with translated(f"put {key} in the {self._what}"):
            return await self._kv.put(key, value)

    async def delete(self, key: str) -> None:
        """Delete a key (absent is fine)."""
        async with translated(f"delete {key} in the {self._what}"):
            await self._kv.delete(key)

    async def keys(self) -> list[str]:
        """Every live key."""
        async with translated(f"list the {self._what}"):
            try:
                return list(await self._kv.keys())
            except jse.NoKeysError:
                return []


def _unlimited(value: int | None) -> int:
    """A stream limit as the server reports it: -1 (or 0, or absent) means none."""
    return -1 if value is None or value <= 0 else int(value)


def _discard(config: StreamConfig) -> DiscardPolicy:
    """The discard policy that matters: only a stream with a byte limit discards."""
    if _unlimited(config.max_bytes) < 0:
        return DiscardPolicy.OLD
    return config.discard or DiscardPolicy.OLD


def _stored(raw: Any) -> StoredMsg:
    return StoredMsg(seq=int(raw.seq), subject=str(raw.subject), data=bytes(raw.data or b""))
