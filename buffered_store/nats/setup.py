"""Setting up the WAL's JetStream objects: the stream, the two KV buckets and the
flusher's durable consumer, created when missing and checked against the configuration
when they exist (a stream tagged for another front-end is refused)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Self

import nats.js.errors as jse
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE
from nats.js.kv import KeyValue

from buffered_store.engine.frontend import FRONT_END_KEY, stream_metadata, tag_of, wrong_front_end
from buffered_store.engine.keys import stream_subjects
from buffered_store.errors import ConfigError, WalObjectMissingError
from buffered_store.nats.errors import translated
from buffered_store.nats.handles import WalHandles
from buffered_store.nats.kv import NatsBucket


class WalSetup(WalHandles):
    """Creating, opening and checking the JetStream objects (part of `NatsWal`)."""

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
        self, confirm_stream: Callable[[Self], Awaitable[None]] | None = None
    ) -> None:
        """Create the stream, buckets and consumer, or check the existing ones agree
        (`confirm_stream`, if given, runs once the stream is there, before the rest)."""
        async with translated("set up JetStream"):
            await self._ensure_stream()
            if confirm_stream is not None:
                await confirm_stream(self)
            self._hot = await self._ensure_bucket(self.config.hot_bucket, history=1)
            quarantine = await self._ensure_bucket(self.config.quarantine_bucket, history=1)
            self._quarantine = self._quarantine_bucket(quarantine)
            await self._ensure_consumer()

    async def open_objects(self) -> None:
        """Open the stream, the consumer and the hot bucket, which must exist
        (`WalObjectMissingError` naming the missing one), and the quarantine bucket if it exists."""
        cfg = self.config
        async with translated("open JetStream objects"):
            try:
                self._check_front_end((await self._js.stream_info(cfg.stream_name)).config)
            except jse.NotFoundError:
                raise WalObjectMissingError(
                    f"the stream {cfg.stream_name!r} does not exist (check the stream name: "
                    "BUFSTORE_STREAM_NAME; only a store or a flusher creates it)"
                ) from None
            try:
                await self._js.consumer_info(cfg.stream_name, cfg.consumer_name)
            except jse.NotFoundError:
                raise WalObjectMissingError(
                    f"the consumer {cfg.consumer_name!r} does not exist on the stream "
                    f"{cfg.stream_name!r} (check BUFSTORE_CONSUMER_NAME)"
                ) from None
            try:
                hot = await self._js.key_value(cfg.hot_bucket)
            except (jse.BucketNotFoundError, jse.NotFoundError):
                raise WalObjectMissingError(
                    f"the bucket {cfg.hot_bucket!r} does not exist (check BUFSTORE_HOT_BUCKET)"
                ) from None
            self._hot = self._bucket_handle(hot, cfg.hot_bucket)
            with contextlib.suppress(jse.BucketNotFoundError, jse.NotFoundError):
                quarantine = await self._js.key_value(cfg.quarantine_bucket)
                self._quarantine = self._quarantine_bucket(
                    self._bucket_handle(quarantine, cfg.quarantine_bucket)
                )

    def _quarantine_bucket(self, kv: KeyValue) -> NatsBucket:
        return NatsBucket(
            kv,
            self.config.quarantine_bucket,
            "quarantine bucket",
            js=self._js,
            nc=self._nc,
            timeout_s=self.config.request_timeout_s,
            leader=not self.direct,
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


def _unlimited(value: int | None) -> int:
    """A stream limit as the server reports it: -1 (or 0, or absent) means none."""
    return -1 if value is None or value <= 0 else int(value)


def _discard(config: StreamConfig) -> DiscardPolicy:
    """The discard policy that matters: only a stream with a byte limit discards."""
    if _unlimited(config.max_bytes) < 0:
        return DiscardPolicy.OLD
    return config.discard or DiscardPolicy.OLD
