"""The KV side of the WAL: the hot bucket (compare-and-set writes on the write path,
scans of recent and of the oldest records) and `NatsBucket`, any bucket as the engine's
`Bucket` port (the quarantine)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import nats.js.errors as jse
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE
from nats.js.kv import KeyValue

from buffered_store.engine.ports import AgedValue, KvValue, StoredMsg
from buffered_store.errors import ConflictError, WalObjectMissingError
from buffered_store.nats.errors import KV_WRONG_LAST, raise_translated, translated
from buffered_store.nats.handles import EXPECTED_LAST_SUBJECT_SEQ, WalHandles
from buffered_store.nats.scan import live_keys, scan_by_consumer, stored_msg

SCAN_DIRECT_GETS = 8
"""Hot records a scan reads with direct gets before it sets up a consumer for the rest."""


class HotKv(WalHandles):
    """The hot metadata bucket's reads and writes (part of `NatsWal`)."""

    @property
    def _hot_kv(self) -> KeyValue:
        """The hot metadata bucket."""
        assert self._hot is not None, "ensure_objects() first"
        return self._hot

    @property
    def quarantine(self) -> NatsBucket:
        """The quarantine bucket (`WalObjectMissingError` when it was not found on
        opening)."""
        if self._quarantine is None:
            raise WalObjectMissingError(
                f"the bucket {self.config.quarantine_bucket!r} was not found"
            )
        return self._quarantine

    async def kv_get(self, key: str) -> KvValue | None:
        """A key's value and revision, or None when absent or deleted."""
        return await kv_entry(self._hot_kv, key)

    async def kv_get_many(self, keys: Sequence[str]) -> list[KvValue | None]:
        """Several keys concurrently."""
        return list(await asyncio.gather(*(self.kv_get(k) for k in keys)))

    async def kv_swap(self, key: str, value: bytes, *, revision: int | None) -> int:
        """Compare-and-set: write if the key is at `revision` (None: if it is absent).

        Returns the new revision; raises `ConflictError` when the key moved meanwhile.
        """
        # `translated` as a plain ``except``: the write path swaps on every checkpoint.
        try:
            if revision is None:
                return await self._hot_kv.create(key, value)
            # `KeyValue.update` is this publish with the expected last subject seq.
            headers = {EXPECTED_LAST_SUBJECT_SEQ: str(revision)}
            seq, _ = await self._js_publish(self._hot_prefix + key, value, headers)
            return seq
        except Exception as exc:
            if isinstance(exc, jse.KeyWrongLastSequenceError) or (
                isinstance(exc, jse.APIError)
                and (exc.err_code in KV_WRONG_LAST or "wrong last sequence" in str(exc))
            ):
                raise ConflictError(f"update {key}: the key changed meanwhile") from exc
            raise_translated(exc, lambda: f"update {key}")

    async def kv_put(self, key: str, value: bytes) -> int:
        """Unconditional write."""
        async with translated(f"put {key}"):
            return await self._hot_kv.put(key, value)

    async def kv_delete(self, key: str) -> None:
        """Delete a key."""
        async with translated(f"delete {key}"):
            await self._hot_kv.delete(key)

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

    async def hot_updates(self, prefix: str, from_seq: int) -> list[StoredMsg]:
        """Messages of the hot bucket's stream on keys starting with `prefix`, from
        `from_seq` on, in stream order (each key once, as the bucket keeps only its
        latest value; with leader reads a key written during the scan may come twice,
        the later one newer).

        `StoredMsg.subject` is the key. The first `SCAN_DIRECT_GETS` come from direct gets
        (one round trip each, nothing to set up); a longer scan continues through a
        short-lived consumer that delivers the rest in batches (where reads go to the
        leader, what the consumer's replica had not applied yet is read from the leader
        after).
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
                msg = stored_msg(raw)
                if msg.data:  # a delete or purge marker has no value
                    found.append(StoredMsg(msg.seq, msg.subject[len(head) :], msg.data))
                seq = msg.seq + 1
            found.extend(
                await scan_by_consumer(
                    self._js,
                    self._nc,
                    stream,
                    subject,
                    seq,
                    head,
                    timeout_s=self.config.request_timeout_s,
                    leader=not self.direct,
                )
            )
        return found

    async def hot_oldest(self, prefix: str, limit: int) -> list[AgedValue]:
        """The least recently written live hot keys under `prefix`: those among the
        bucket stream's first `limit` seqs (one consumer delivering them in a batch)."""
        stream = f"KV_{self.config.hot_bucket}"
        head = self._hot_prefix
        async with translated("scan the oldest hot records"):
            info = await self._js.stream_info(stream)
            first = max(1, int(info.state.first_seq or 1))
            times: dict[int, float] = {}
            found = await scan_by_consumer(
                self._js,
                self._nc,
                stream,
                f"{head}{prefix}>",
                first,
                head,
                last=first + limit - 1,
                times=times,
                timeout_s=self.config.request_timeout_s,
            )
        return [AgedValue(m.subject, m.data, m.seq, times.get(m.seq, 0.0)) for m in found]


async def kv_entry(kv: KeyValue, key: str) -> KvValue | None:
    """A key's value and revision, or None when absent or deleted."""
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

    def __init__(
        self,
        kv: KeyValue,
        bucket: str,
        what: str,
        *,
        js: JetStreamContext,
        nc: Client,
        timeout_s: float,
        leader: bool = False,
    ) -> None:
        self._kv = kv
        self._leader = leader
        self._what = what
        self._stream = KV_STREAM_TEMPLATE.format(bucket=bucket)
        self._head = KV_PRE_TEMPLATE.format(bucket=bucket)
        self._js = js
        self._nc = nc
        self._timeout_s = timeout_s

    async def get(self, key: str) -> KvValue | None:
        """A key's value and revision, or None when absent or deleted."""
        return await kv_entry(self._kv, key)

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
        """Every live key (`scan.live_keys`: one consumer, no guess at the end)."""
        async with translated(f"list the {self._what}"):
            return await live_keys(
                self._js,
                self._nc,
                self._stream,
                self._head,
                timeout_s=self._timeout_s,
                leader=self._leader,
            )
