"""Putting messages into quarantine during a cycle: payloads that are not entries, and
the entries of a thread that keeps failing to apply.

The policy (when) is in `flusher.policy`; this module does the writes and the terms, in
the safe order: the record first, the term after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from buffered_store.backoff import Backoff
from buffered_store.engine.entries import Entry
from flusher.config import FlusherConfig
from flusher.held import Held, Settler, ThreadWork
from flusher.policy import Settle, Undecodable, undecodable_action
from flusher.quarantine import (
    RECORD_FAILURES,
    Quarantine,
    QuarantineKind,
    QuarantineRecord,
    undecodable_record,
)
from flusher.stats import FlusherStats

log = logging.getLogger("flusher")


class Poison:
    """Quarantine writes and terminations of one flusher."""

    def __init__(
        self,
        *,
        quarantine: Quarantine,
        subject_of: Callable[[str], str],
        config: FlusherConfig,
        stats: FlusherStats,
        settler: Settler,
        clock: Callable[[], datetime],
    ) -> None:
        self.quarantine = quarantine
        self.subject_of = subject_of
        self.config = config
        self.stats = stats
        self.settler = settler
        self.clock = clock
        self.backoff = Backoff(config.nak_delay_initial_s, config.nak_delay_max_s)

    async def undecodable(self, held: Held, bad: Undecodable) -> None:
        """Record a payload that is not an entry (once), then terminate it.

        It holds no data and no seq, so nothing waits for it; if the record cannot be
        written it is given back, but terminated anyway after a bounded number of
        deliveries so that the consumer never loops on it.
        """
        msg = held.msg
        record = undecodable_record(
            bad,
            subject=msg.subject,
            stream_seq=msg.stream_seq,
            data=msg.data,
            deliveries=held.num_delivered,
            now=self.clock(),
        )
        extra = {"action": "quarantine_message", "stream_seq": record.stream_seq}
        try:
            created = await self.quarantine.add_message(record)
            recorded = True
        except RECORD_FAILURES as exc:
            created = recorded = False
            log.warning("could not write a quarantine record: %s", exc, extra=extra)
        action = undecodable_action(
            recorded=recorded,
            num_delivered=held.num_delivered,
            poison_attempts=self.config.poison_attempts,
        )
        if action is Settle.TERM and created:
            self.stats.quarantined_messages += 1
            log.warning(
                "quarantined a message that is not a WAL entry: %s", bad.reason[:200], extra=extra
            )
        elif action is Settle.TERM and not recorded:
            self.stats.dropped_unrecorded += 1
            log.error(
                "dropped a message that is not a WAL entry without a quarantine record "
                "after %d deliveries",
                held.num_delivered,
                extra={**extra, "action": "poison_dropped"},
            )
        await self.settler.one(held, action, self.backoff.delay(held.num_delivered))

    async def join_if_quarantined(self, work: ThreadWork) -> bool:
        """When the thread is quarantined already (by any flusher), its held entries cannot
        apply either: add them to its record and terminate them. True when done so."""
        try:
            record = await self.quarantine.thread_record(work.thread_id)
        except RECORD_FAILURES:
            return False
        if record is None:
            return False
        await self.terminate(work, work.unsettled(), record.reason, record.seq)
        return True

    async def terminate(
        self,
        work: ThreadWork,
        held: list[Held],
        reason: str,
        seq: int | None,
        *,
        culprit: Entry | None = None,
    ) -> None:
        """Record entries in the thread's quarantine record, then terminate their messages.

        Entries hold acknowledged checkpoints, so they are never terminated without a
        record: when the bucket cannot be written they are given back with a long delay.
        """
        now = self.clock()
        stream_seqs = [h.entry.stream_seq for h in held if h.entry]
        extra = {"action": "quarantine_thread", "seq": seq, "entries": len(stream_seqs)}
        try:
            if culprit is not None:
                await self.quarantine.add_message(self._culprit_record(work, held, culprit, reason))
                stream_seqs.append(culprit.stream_seq)
            created = await self.quarantine.add_thread(
                work.thread_id, reason=reason, seq=seq, stream_seqs=stream_seqs, now=now
            )
        except RECORD_FAILURES as exc:
            log.error("could not quarantine a failing thread: %s", exc, extra=extra)
            await self.settler.all(work.held, Settle.NAK, self.config.nak_delay_max_s)
            return
        if created:
            self.stats.quarantined_threads += 1
            log.warning("quarantined a thread: %s", reason[:200], extra=extra)
        self.stats.quarantined_messages += len(held)
        await self.settler.all(held, Settle.TERM)
        # Anything else held for the thread (duplicates below the culprit) goes back.
        await self.settler.all(work.held, Settle.NAK, self.config.requeue_delay_s)

    def _culprit_record(
        self, work: ThreadWork, held: list[Held], culprit: Entry, reason: str
    ) -> QuarantineRecord:
        source = next((h for h in held if h.entry and h.entry.seq == culprit.seq), None)
        return QuarantineRecord(
            kind=QuarantineKind.MESSAGE,
            reason=reason,
            at=self.clock(),
            thread_id=work.thread_id,
            subject=self.subject_of(work.thread_id),
            stream_seq=culprit.stream_seq,
            seq=culprit.seq,
            payload_bytes=len(source.msg.data) if source else 0,
            deliveries=source.num_delivered if source else 0,
        )
