"""Claiming run ids for a thread before a checkpoint writes them (`RunClaims`).

Runs are keyed by id alone, so the first checkpoint of a run claims its id in the hot
bucket (``r.<run id>``, encoded by `threadrun.claims`); a later checkpoint of the same
run on another thread is refused (`RunOwnershipError`) while the claim holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Any

from buffered_store.backoff import backoff_s
from buffered_store.config import BufferedStoreConfig
from buffered_store.engine.buffer import WriteBuffer
from buffered_store.engine.ids import utcnow
from buffered_store.errors import ConflictError, WalUnavailableError
from buffered_store.model.changes import (
    WalEntry,
)
from buffered_store.model.checkpointing import run_owned_elsewhere
from buffered_store.threadrun.claims import decode_run_claim, encode_run_claim, run_key
from buffered_store.threadrun.entry import (
    HotRecord,
)
from buffered_store.threadrun.overlay import Overlay


class RunClaims:
    """The run claims of one store instance (its cursors remember the claims made)."""

    def __init__(
        self,
        buffer: WriteBuffer[WalEntry, HotRecord, Any],
        reads: Overlay,
        config: BufferedStoreConfig,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._buffer = buffer
        self._reads = reads
        self._config = config
        self._clock = clock

    def held(self, thread_id: str, run_id: str) -> bool:
        """Whether this instance already holds the claim (its cached cursor says so):
        `claim` would return at once, so the write path does not call it."""
        cursor = self._buffer.writer.cursors.get(thread_id)
        return cursor is not None and run_id in cursor.claims

    async def claim(self, thread_id: str, run_id: str, deadline: float) -> None:
        """Claim `run_id` for the thread in the KV run claims before anything is written.

        Runs are keyed by id alone: a run id checkpointed on a second thread would move
        the run. The claim is a create-if-absent, made once per run and instance (one
        round trip on a run's first checkpoint, none after). An existing claim by another
        thread is honoured while that thread holds the run, and for `run_claim_grace_s`
        after it was made even when it does not (yet): the checkpoint that claimed it may
        still be on its way. After that the claim is stale (the thread was deleted, or
        its checkpoint never landed) and is taken over. Retried while NATS is
        unreachable, until `deadline` (the checkpoint's).
        """
        cursor = await self._buffer.writer.cursor(thread_id)
        if run_id in cursor.claims:
            return
        failures = 0
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    try:
                        if await self._try(thread_id, run_id, cursor.seq):
                            break
                    except WalUnavailableError:
                        failures += 1
                        await asyncio.sleep(backoff_s(failures, initial_s=0.05, max_s=1.0))
        except TimeoutError as exc:
            raise WalUnavailableError(
                f"checkpoint of thread {thread_id!r}: could not claim run {run_id!r} in time"
            ) from exc
        cursor.claims.add(run_id)

    async def _try(self, thread_id: str, run_id: str, seq: int) -> bool:
        """One claiming attempt: True when the thread holds the claim, False to retry.

        `seq` is the thread's seq as the claimer knows it: a delete of the owner with a
        higher seq happened after the claim (or after a stale cursor, whose checkpoint
        then fails its compare-and-set, sees the delete and claims again).
        """
        key = run_key(run_id)
        now_us = round(self._clock().timestamp() * 1e6)
        mine = encode_run_claim(thread_id, now_us, seq)
        try:
            await self._buffer.wal.kv_swap(key, mine, revision=None)
            return True
        except ConflictError:
            pass
        current = await self._buffer.wal.kv_get(key)
        if current is None:
            return False  # deleted meanwhile: create it again
        owner, claimed_at_us, claimed_seq = decode_run_claim(current.value)
        if owner != thread_id:
            run, owner_hot = await asyncio.gather(
                self._reads.load_run_overlay(run_id), self._buffer.log.hot(owner)
            )
            if run is not None and run.thread_id != thread_id:
                raise run_owned_elsewhere(run_id, run.thread_id, thread_id)
            # Deleted after the claim, even if re-created since: its delete seq is above
            # the seq the claim was made at (claims without a seq: the thread is deleted
            # now and its hot record is newer than the claim, both in the hot bucket's
            # stream). A checkpoint built before the delete fails its CAS and, once it
            # has seen the delete, claims again (see the store's `_ClaimLost`).
            deleted_since = owner_hot is not None and (
                (claimed_seq is not None and owner_hot.record.deleted_seq > claimed_seq)
                or (owner_hot.record.thread is None and owner_hot.revision > current.revision)
            )
            lapsed = now_us - claimed_at_us >= self._config.run_claim_grace_s * 1e6
            if run is None and not (deleted_since or lapsed):
                raise run_owned_elsewhere(run_id, owner, thread_id)
        # Our own claim is written again too, so that it is newer than any delete of the
        # thread this instance has seen.
        try:
            await self._buffer.wal.kv_swap(key, mine, revision=current.revision)
        except ConflictError:
            return False  # claimed by someone else meanwhile: judge the new claim
        return True
