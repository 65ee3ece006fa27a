"""One flush cycle: the messages of a collection window, applied and settled.

Per cycle: decode every message (undecodable ones go to quarantine at once), group the
entries by thread, make ONE `FlushSink.apply` call with a batch per thread, then for
each thread carry out what `policy.plan_outcome` decided: raise the KV flushed mark and
only then ack, fetch missing earlier entries from the stream and apply again (a bounded
number of rounds), give messages back with a delay, or quarantine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from buffered_store.backoff import Backoff
from buffered_store.engine.entries import Entry
from buffered_store.engine.flushing import ApplyOutcome, ApplyStatus, FlushSink
from buffered_store.engine.ports import Delivered
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import (
    DatabaseUnavailableError,
    StoreError,
    WalEntriesMissingError,
    WalUnavailableError,
)
from flusher.config import FlusherConfig
from flusher.faults import maybe_crash
from flusher.held import Held, Settler, ThreadWork
from flusher.poison import Poison
from flusher.policy import (
    Isolation,
    Settle,
    Step,
    ThreadPlan,
    Undecodable,
    classify,
    plan_outcome,
)
from flusher.quarantine import Quarantine
from flusher.stats import FlusherStats

log = logging.getLogger("flusher")

_MAX_TRACKED_FAILURES = 10_000


class CycleRunner:
    """Applies and settles the messages of one cycle at a time."""

    def __init__(
        self,
        *,
        target: FlushSink[Any],
        thread_log: ThreadLog[Any, Any],
        quarantine: Quarantine,
        config: FlusherConfig,
        stats: FlusherStats,
        clock: Callable[[], datetime],
    ) -> None:
        self.target = target
        self.thread_log = thread_log
        self.config = config
        self.stats = stats
        self.clock = clock
        self.held: list[Held] = []
        """Messages of the running cycle (kept alive with in-progress acks meanwhile)."""
        self._nak_backoff = Backoff(config.nak_delay_initial_s, config.nak_delay_max_s)
        self.settler = Settler(stats)
        self.poison = Poison(
            quarantine=quarantine,
            subject_of=thread_log.subject,
            config=config,
            stats=stats,
            settler=self.settler,
            clock=clock,
        )
        self._failures: dict[str, tuple[int, int]] = {}
        self._db_down = False

    async def run(self, msgs: Sequence[Delivered]) -> None:
        """Apply and settle one cycle's messages; unsettled ones are given back at the end."""
        started = asyncio.get_running_loop().time()
        self.held = [Held(msg) for msg in msgs]
        self.stats.cycles += 1
        self.stats.held = len(self.held)
        try:
            cpu = time.process_time()
            work, bad = self._decode()
            self.stats.cpu_decode_s += time.process_time() - cpu
            maybe_crash("mid_batch")
            await asyncio.gather(*(self.poison.undecodable(h, b) for h, b in bad))
            for _ in range(self.config.max_rounds):
                if not work:
                    break
                work = await self._round(work)
            self._record_lag()
        finally:
            # Leftovers (rounds exhausted, errors, cancellation by stop) go back to the
            # server at once, so another flusher or the next cycle takes them.
            await self.settler.all(self.held, Settle.NAK, self.config.requeue_delay_s)
            self.held = []
            self.stats.held = 0
            duration = asyncio.get_running_loop().time() - started
            self.stats.last_flush_duration_s = duration
            self.stats.flush_duration.observe(duration)

    # -- decoding ------------------------------------------------------------------------

    def _decode(self) -> tuple[dict[str, ThreadWork], list[tuple[Held, Undecodable]]]:
        work: dict[str, ThreadWork] = {}
        bad: list[tuple[Held, Undecodable]] = []
        stream = self.config.stream_name
        for held in self.held:
            msg = held.msg
            self.stats.messages += 1
            if msg.num_delivered > 1:
                self.stats.redeliveries += 1
            result = classify(self.thread_log.fmt, stream, msg.subject, msg.data, msg.stream_seq)
            if isinstance(result, Undecodable):
                bad.append((held, result))
                continue
            held.entry = result
            self.stats.entries += 1
            work.setdefault(result.thread_id, ThreadWork(result.thread_id, [])).held.append(held)
        return work, bad

    # -- apply rounds --------------------------------------------------------------------

    async def _round(self, work: dict[str, ThreadWork]) -> dict[str, ThreadWork]:
        items = list(work.values())
        cpu = time.process_time()
        batches = [item.batch() for item in items]
        outcomes = await self.apply(batches)
        applied = time.process_time()
        self.stats.cpu_apply_s += applied - cpu
        results = await asyncio.gather(
            *(self._after(w, b, o) for w, b, o in zip(items, batches, outcomes, strict=True))
        )
        self.stats.cpu_settle_s += time.process_time() - applied
        return {w.thread_id: w for w in results if w is not None}

    async def apply(self, batches: Sequence[Sequence[Entry]]) -> list[ApplyOutcome]:
        """`target.apply`, retried with capped exponential back-off for as long as the
        database is unavailable (cancelled by `stop`); one WARNING per outage, one INFO
        when it ends."""
        backoff = Backoff(
            self.config.db_retry_initial_s,
            self.config.db_retry_max_s,
            jitter_s=self.config.db_retry_initial_s,
        )
        while True:
            self.stats.transactions += 1
            try:
                outcomes = await self._bounded_apply(batches)
                break
            except DatabaseUnavailableError as exc:
                self._db_retrying(exc)
                await asyncio.sleep(backoff.next_delay())
        maybe_crash("after_commit")
        if self._db_down:
            self._db_down = False
            log.info("database reachable again", extra={"action": "db_recovered"})
        if len(outcomes) != len(batches):
            raise StoreError(f"apply returned {len(outcomes)} outcomes for {len(batches)} batches")
        return outcomes

    async def _bounded_apply(self, batches: Sequence[Sequence[Entry]]) -> list[ApplyOutcome]:
        """`target.apply`, abandoned after `apply_timeout_s`: cancelling it closes its
        connection (nothing of it commits but what did before the bound), and the cycle
        runs again like after a lost database. Entries a late commit did apply are then
        stale for their watermark: applied once."""
        limit = self.config.apply_timeout_s
        bound = asyncio.timeout(limit)
        try:
            async with bound:
                return await self.target.apply(batches)
        except TimeoutError as exc:
            if not bound.expired():
                raise
            self.stats.apply_timeouts += 1
            raise DatabaseUnavailableError(
                f"a flush transaction of {len(batches)} threads ran over apply_timeout_s "
                f"({limit:g} s) and was abandoned; it runs again (raise apply_timeout_s if "
                "cycles this large are expected)"
            ) from exc

    def _db_retrying(self, error: DatabaseUnavailableError) -> None:
        self.stats.db_retries += 1
        if not self._db_down:
            self._db_down = True
            self.stats.db_retry_episodes += 1
            log.warning(
                "database unavailable, retrying with back-off: %s",
                error,
                extra={"action": "db_unavailable"},
            )

    async def _after(
        self, work: ThreadWork, batch: list[Entry], outcome: ApplyOutcome
    ) -> ThreadWork | None:
        outcome = await self._with_owner(batch, outcome)
        if await self._waits_for_owner(work, outcome):
            return None
        failures = self._count_failure(work.thread_id, outcome)
        if outcome.status is ApplyStatus.FAILED:
            self.stats.apply_failures += 1
            if not outcome.retriable and await self.poison.join_if_quarantined(work):
                return None
        plan = plan_outcome(
            outcome,
            batch,
            work.seqs(),
            failures=failures,
            poison_attempts=self.config.poison_attempts,
            backoff=self._nak_backoff,
        )
        if outcome.status is ApplyStatus.APPLIED:
            self._count_applied(batch, outcome.flushed_seq)
        if not await self._confirm(work, plan, stale=outcome.status is ApplyStatus.STALE):
            return None
        if plan.step is Step.DONE:
            return None
        if plan.step is Step.RETRY:
            return work
        if plan.step is Step.FETCH:
            return await self._fill(work, plan)
        if plan.step is Step.QUARANTINE:
            await self._quarantine_thread(work, plan.reason, outcome.flushed_seq)
            return None
        log.info(
            "thread could not be flushed, retrying later: %s",
            plan.reason[:200],
            extra={"action": "apply_failed", "retriable": outcome.retriable},
        )
        await self.settler.all(work.held, Settle.NAK, plan.delay_s)
        return None

    async def _with_owner(self, batch: Sequence[Entry], outcome: ApplyOutcome) -> ApplyOutcome:
        """Apply a batch refused a run whose owner still has unflushed entries
        (`ApplyOutcome.waits_for`) again, in one call with the owner's entries read from
        the stream: the sink writes the owner's delete first, which frees the run (two
        re-created threads that swapped their runs can only be written together). The
        owner's messages, wherever they are, find them applied (stale) and are acked.
        Returns the batch's new outcome (the refusal itself when the owner has nothing
        unflushed or its entries cannot be read)."""
        owner = outcome.waits_for
        if outcome.status is not ApplyStatus.FAILED or owner is None or owner == outcome.thread_id:
            return outcome
        try:
            hot, upto = await self.thread_log.latest(owner)
            flushed = (await self.target.flushed_seqs([owner]))[owner]
            if flushed >= upto:
                return outcome
            entries = await self.thread_log.entries_between(
                owner, flushed, upto, hot.record if hot is not None else None
            )
        except (WalUnavailableError, WalEntriesMissingError, DatabaseUnavailableError):
            return outcome  # decided as the refusal it is
        if not entries:
            return outcome
        _, again = await self.apply([entries, batch])
        if again.status is ApplyStatus.APPLIED:
            self.stats.applied_with_owner += 1
        log.info(
            "thread applied again with the unflushed entries of the thread owning one of "
            "its runs: %s",
            again.status.value,
            extra={"action": "apply_with_owner", "owner": owner},
        )
        return again

    async def _waits_for_owner(self, work: ThreadWork, outcome: ApplyOutcome) -> bool:
        """Give a thread's messages back, without counting a failure towards its
        quarantine, when it was refused a run whose owner still has unflushed entries
        (`ApplyOutcome.waits_for`): the owner's delete, not applied yet (held by another
        flusher, backing off, or in a later cycle), is what frees the run. Bounded: past
        twice `poison_attempts` deliveries the refusal counts as any other."""
        owner = outcome.waits_for
        if outcome.status is not ApplyStatus.FAILED or owner is None or owner == work.thread_id:
            return False
        deliveries = max((h.num_delivered for h in work.seqs()), default=1)
        if deliveries >= 2 * self.config.poison_attempts:
            return False
        try:
            _, upto = await self.thread_log.latest(owner)
            flushed = (await self.target.flushed_seqs([owner]))[owner]
        except (WalUnavailableError, DatabaseUnavailableError):
            return False  # decided as any other refusal
        if flushed >= upto:
            return False
        self.stats.apply_failures += 1
        log.info(
            "thread waits for the flush of the thread owning one of its runs: %s",
            (outcome.error or "")[:200],
            extra={"action": "apply_waits_for_owner", "owner": owner},
        )
        await self.settler.all(work.held, Settle.NAK, self._nak_backoff.delay(deliveries))
        return True

    async def _confirm(self, work: ThreadWork, plan: ThreadPlan, *, stale: bool = False) -> bool:
        """Ack what the committed watermark covers. (The watermark lives in the sink,
        committed with the data: no KV mark is raised per thread and cycle.)"""
        covered = [h for h in work.unsettled() if h.entry and h.entry.seq <= plan.ack_upto]
        if stale:
            self.stats.stale_entries += len(covered)
        await self.settler.all(covered, Settle.ACK)
        work.forget_upto(plan.ack_upto)
        return True

    async def _fill(self, work: ThreadWork, plan: ThreadPlan) -> ThreadWork | None:
        """Fetch the missing entries (`fetch_after`, `fetch_upto`] from the stream."""
        try:
            hot = await self.thread_log.hot(work.thread_id)
            entries = await self.thread_log.entries_between(
                work.thread_id, plan.fetch_after, plan.fetch_upto, hot.record if hot else None
            )
        except WalUnavailableError as exc:
            log.warning(
                "could not fetch missing entries: %s", exc, extra={"action": "gap_fetch_failed"}
            )
            await self.settler.all(work.held, Settle.NAK, self.config.requeue_delay_s)
            return None
        except WalEntriesMissingError as exc:
            # The entries are gone from the stream (expired unflushed): the thread can
            # never apply in order again; after the usual attempts it goes to quarantine.
            self.stats.apply_failures += 1
            missing = ApplyOutcome(
                work.thread_id,
                ApplyStatus.FAILED,
                plan.fetch_after,
                error=str(exc),
                retriable=False,
            )
            failures = self._count_failure(work.thread_id, missing)
            attempts = max([failures, *(h.num_delivered for h in work.unsettled())])
            if attempts >= self.config.poison_attempts:
                await self.poison.terminate(work, work.unsettled(), str(exc), plan.fetch_after + 1)
            else:
                await self.settler.all(work.held, Settle.NAK, self._nak_backoff.delay(attempts))
            return None
        self.stats.gaps += 1
        self.stats.entries_fetched += len(entries)
        work.fetched.update((e.seq, e) for e in entries)
        return work

    def _count_applied(self, batch: Sequence[Entry], flushed_seq: int) -> None:
        """Count an APPLIED batch, and the flush lag of each of its entries: from the
        checkpoint to the commit that just returned (clamped at 0 for clock skew)."""
        committed = self.clock()
        applied = [e for e in batch if e.seq <= flushed_seq]
        self.stats.threads_applied += 1
        self.stats.entries_applied += len(applied)
        for entry in applied:
            self.stats.flush_lag.observe(max(0.0, (committed - entry.at).total_seconds()))

    def _count_failure(self, thread_id: str, outcome: ApplyOutcome) -> int:
        """Non-retriable failures of the thread's first unflushed seq, across cycles."""
        if outcome.status is ApplyStatus.APPLIED:
            self._failures.pop(thread_id, None)
            return 0
        if outcome.status is not ApplyStatus.FAILED or outcome.retriable:
            return self._failures.get(thread_id, (0, 0))[1]
        first = outcome.flushed_seq + 1
        previous = self._failures.pop(thread_id, None)
        count = previous[1] + 1 if previous and previous[0] == first else 1
        self._failures[thread_id] = (first, count)
        if len(self._failures) > _MAX_TRACKED_FAILURES:
            del self._failures[next(iter(self._failures))]
        return count

    # -- quarantine of threads -------------------------------------------------------------

    async def _quarantine_thread(self, work: ThreadWork, reason: str, watermark: int) -> None:
        """Apply what precedes the culprit, then quarantine the culprit and what follows."""
        isolation = Isolation([e for e in work.batch() if e.seq > watermark])
        while not isolation.done:
            chunk = isolation.chunk()
            [outcome] = await self.apply([chunk])
            if outcome.status is ApplyStatus.APPLIED:
                self._count_applied(chunk, outcome.flushed_seq)
                plan = plan_outcome(
                    outcome, chunk, [], failures=0, poison_attempts=1, backoff=self._nak_backoff
                )
                if not await self._confirm(work, plan):
                    return
                isolation.applied(outcome.flushed_seq)
            elif outcome.status is ApplyStatus.FAILED and not outcome.retriable:
                reason = outcome.error or reason
                isolation.failed()
            else:
                # Another flusher moved the thread, or the failure turned transient:
                # give the messages back and decide again on redelivery.
                await self.settler.all(work.held, Settle.NAK, self.config.requeue_delay_s)
                return
        culprit = isolation.culprit
        if culprit is None:
            return
        self._failures.pop(work.thread_id, None)
        rest = [h for h in work.unsettled() if h.entry and h.entry.seq >= culprit.seq]
        await self.poison.terminate(work, rest, reason, culprit.seq, culprit=culprit)

    def _record_lag(self) -> None:
        oldest = min((h.entry.at for h in self.held if h.entry is not None), default=None)
        if oldest is None:
            return
        lag = max(0.0, (self.clock() - oldest).total_seconds())
        self.stats.last_lag_s = lag
        self.stats.max_lag_s = max(self.stats.max_lag_s, lag)
