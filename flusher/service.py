"""`Flusher`: drains the WAL into the inner store, embedded or as its own process.

Any number of flushers share the durable pull consumer; the server spreads messages
between them. Correctness does not depend on who gets what: the target checks each
thread's watermark inside its transaction, so duplicated, stale or reordered entries
never overwrite newer data, and a flusher missing earlier entries fetches them from the
stream. Each cycle (see `flusher.cycle`) commits, raises the KV flushed marks, and only
then acks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Any

from buffered_store.backoff import backoff_s
from buffered_store.config import EngineConfig
from buffered_store.engine.entries import Format
from buffered_store.engine.flushing import FlushSink
from buffered_store.engine.frontend import front_end_of
from buffered_store.engine.ids import utcnow
from buffered_store.engine.ports import Delivered, Wal
from buffered_store.engine.threadlog import ThreadLog
from buffered_store.errors import (
    ConfigError,
    FlusherNotStartedError,
    FlusherStartedError,
    FlushTimeoutError,
    WalObjectMissingError,
    WalRefusedError,
    WalUnavailableError,
)
from buffered_store.metrics_core import HistogramSnapshot
from buffered_store.model.protocol import ThreadRunStore
from buffered_store.nats import NatsWal
from buffered_store.tasks import cancel_and_wait
from buffered_store.threadrun.entry import FORMAT
from buffered_store.threadrun.generic import GenericFlushTarget, KvWatermarks
from flusher.config import FlusherConfig
from flusher.cycle import CycleRunner
from flusher.frontends import confirm_front_end
from flusher.held import Held, Settler
from flusher.intake import Intake
from flusher.policy import Settle
from flusher.quarantine import Quarantine
from flusher.stats import FlusherStats
from flusher.trim import Trimmer

log = logging.getLogger("flusher")

_SHARED_NAMES = ("stream_name", "hot_bucket", "quarantine_bucket", "consumer_name")

BACKLOG_SCAN_LIMIT = 1000
"""Most WAL tail entries one backlog poll reads to count pending threads (bounds its
cost during an outage, when the tail grows)."""


class Flusher:
    """The WAL drain service: durable pull consumer, batching window, ack after watermark,
    retries, quarantine.

    Args:
        inner: the store to flush into. A `FlushSink` (for thread-runs: the Postgres and
            in-memory stores) applies each batch atomically with its watermark; any other
            `ThreadRunStore` is wrapped in the at-least-once `GenericFlushTarget`
            (watermarks in the KV flushed marks).
        config: a `FlusherConfig`, or any `EngineConfig` (a store's) whose shared
            settings are copied; None reads ``BUFSTORE_*`` environment variables.
        wal: an open `Wal` to use (not closed by `stop`); by default the flusher opens
            its own connection, which reconnects forever.
        fmt: the front-end whose entries the WAL holds (`Format`); the thread-run
            front-end's by default. Another front-end's needs its own `FlushSink` as
            `inner` (and its own stream, bucket and consumer names in `config`).
        clock: wall-clock time, for lag figures and quarantine records.
        backlog_poll_s: seconds between polls of the consumer for the backlog gauges of
            `stats()` (two requests, plus one direct get per tail entry up to
            `BACKLOG_SCAN_LIMIT` while there is a backlog); 0 disables the poll.
    """

    def __init__(
        self,
        inner: ThreadRunStore | FlushSink[Any],
        config: EngineConfig | None = None,
        *,
        wal: Wal | None = None,
        fmt: Format[Any, Any] | None = None,
        clock: Callable[[], datetime] = utcnow,
        name: str = "bufstore-flusher",
        backlog_poll_s: float = 5.0,
    ) -> None:
        if config is None:
            config = FlusherConfig.from_env()
        elif not isinstance(config, FlusherConfig):
            config = FlusherConfig.from_store_config(config)
        if wal is not None:
            clashes = [n for n in _SHARED_NAMES if getattr(wal.config, n) != getattr(config, n)]
            if clashes:
                raise ConfigError(f"the given Wal is configured differently: {', '.join(clashes)}")
        self.inner = inner
        self.config: FlusherConfig = config
        self.clock = clock
        self.name = name
        self._wal = wal
        self._owns_wal = wal is None
        self._stats = FlusherStats(wal_max_bytes=config.wal_max_bytes or 0)
        self._fmt: Format[Any, Any] = FORMAT if fmt is None else fmt
        if fmt is not None and not isinstance(inner, FlushSink):
            raise ConfigError(
                "a flusher of another front-end's format needs that front-end's FlushSink"
            )
        self._target: FlushSink[Any] | None = None
        self._thread_log: ThreadLog[Any, Any] | None = None
        self._runner: CycleRunner | None = None
        self._intake: Intake | None = None
        self._task: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._trimming: asyncio.Task[None] | None = None
        self._backlog_poll_s = backlog_poll_s
        self._stop = asyncio.Event()
        self._tick = asyncio.Event()
        self._stopped = False
        self._running: asyncio.Task[None] | None = None
        """The running cycle (at most one at a time)."""
        self._cycle_failures = 0
        """Cycles failed in a row (each makes the pause before the next one longer)."""
        self._cpu_mark = 0.0

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def front_end(self) -> str:
        """The front-end whose WAL this flusher drains (its format's name; ``custom`` for
        a format that names none): the ``front_end`` label of its metrics."""
        return front_end_of(self._fmt) or "custom"

    @property
    def running(self) -> bool:
        """Whether the drain loop runs."""
        return self._task is not None and not self._task.done()

    @property
    def wal(self) -> Wal:
        """The WAL connection (after `start`)."""
        if self._wal is None:
            raise FlusherNotStartedError("the flusher is not started")
        return self._wal

    @property
    def target(self) -> FlushSink[Any]:
        """What batches are applied to (after `start`)."""
        if self._target is None:
            raise FlusherNotStartedError("the flusher is not started")
        return self._target

    async def start(self) -> None:
        """Connect (unless given a `Wal`), bind to the durable consumer and start draining."""
        if self._task is not None:
            raise FlusherStartedError("the flusher was started already")
        if self._wal is None:
            fmt = self._fmt
            self._wal = await NatsWal.connect(
                self.config,
                name=self.name,
                front_end=front_end_of(fmt),
                confirm_stream=lambda wal: confirm_front_end(wal, fmt),
            )
        wal = self._wal
        thread_log = ThreadLog(wal, self.config, self._fmt)
        self._thread_log = thread_log
        if isinstance(self.inner, FlushSink):
            self._target = self.inner
        else:
            self._target = GenericFlushTarget(self.inner, KvWatermarks(thread_log))
        self._runner = CycleRunner(
            target=self._target,
            thread_log=thread_log,
            quarantine=Quarantine(wal),
            config=self.config,
            stats=self._stats,
            clock=self.clock,
        )
        self._intake = Intake(wal, self.config, self._stats)
        try:
            await self._intake.open()
        except BaseException:
            await self._close_wal()
            raise
        self._stop.clear()
        self._task = asyncio.create_task(self._drain_loop(), name=f"{self.name}-loop")
        if self._backlog_poll_s > 0:
            self._poller = asyncio.create_task(self._poll_backlog(), name=f"{self.name}-backlog")
        if self.config.trim_interval_s > 0:
            self._trimming = asyncio.create_task(
                self._trim_loop(
                    Trimmer(wal, self.config, self._stats, target=self._target, fmt=self._fmt)
                ),
                name=f"{self.name}-trim",
            )
        log.info(
            "flusher started",
            extra={"action": "flusher_started", "consumer": self.config.consumer_name},
        )

    async def stop(self, drain: bool = True) -> None:
        """Stop draining, in phases: stop fetching; with `drain`, let the current cycle
        flush and settle what it holds (up to `drain_timeout_s`); cancel what is left
        (its messages, and those collected for the next cycle, are given back for
        redelivery); drop the subscription; close the connection if the flusher opened
        it."""
        task = self._task
        if task is None or self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if drain and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), self.config.drain_timeout_s)
            except TimeoutError:
                log.warning(
                    "drain did not finish in time; giving messages back",
                    extra={"action": "drain_timeout"},
                )
            except Exception:
                pass  # the loop's own error is logged there; stopping goes on
        if not task.done() and self._running is not None:
            # Cancel the cycle, not the loop: a fetch cancelled midway can lose messages
            # it already received (redelivered only after ack_wait), so the loop ends at
            # its next fetch boundary and gives back what it collected meanwhile.
            self._running.cancel()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), self.config.fetch_timeout_s + 1.0)
        if not task.done():
            task.cancel()  # once: its own clean-up gives the messages it holds back
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        for helper in (self._poller, self._trimming):
            if helper is not None:
                await cancel_and_wait(helper)
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await helper
        if self._intake is not None:
            await self._intake.close()
        await self._close_wal()
        log.info("flusher stopped", extra={"action": "flusher_stopped", "stats": self.stats()})

    async def __aenter__(self) -> Flusher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop(drain=True)

    async def _close_wal(self) -> None:
        if self._owns_wal and self._wal is not None:
            await self._wal.close()
            self._wal = None  # a failed start() can be retried with a fresh connection

    # -- observation -----------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """Counters and gauges (see `FlusherStats`), plus `coalesced_entries` and
        `running` (1 while the drain loop runs)."""
        return {**self._stats.as_dict(), "running": int(self.running)}

    def histograms(self) -> dict[str, HistogramSnapshot]:
        """Distributions: ``flush_duration_seconds`` (per cycle) and
        ``flush_lag_seconds`` (per applied entry, checkpoint to commit)."""
        return self._stats.histograms()

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Return once this flusher holds nothing and the consumer has no message left to
        deliver or awaiting an ack (from any flusher). Raises `FlushTimeoutError`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if not self._holding:
                info = await self.wal.consumer_state()
                if not info.num_pending and not info.num_ack_pending:
                    return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise FlushTimeoutError(f"the flusher was not idle within {timeout_s}s")
            self._tick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._tick.wait(), min(remaining, 0.5))

    async def _poll_backlog(self) -> None:
        """Refresh the backlog gauges every `backlog_poll_s` until stopped."""
        while not self._stop.is_set():
            try:
                await self._read_backlog()
            except Exception as exc:
                # The fetch loop reports NATS trouble; a missed poll only ages the gauges.
                self._stats.backlog_poll_failures += 1
                log.debug("backlog poll failed: %r", exc, extra={"action": "backlog_poll_failed"})
            await self._pause(self._backlog_poll_s)

    async def _trim_loop(self, trimmer: Trimmer) -> None:
        """Trim flushed entries from the stream every `trim_interval_s` until stopped."""
        while not self._stop.is_set():
            try:
                await trimmer.run_once()
            except Exception as exc:
                # Nothing is lost by a missed trim: the next one purges the same and more.
                self._stats.trim_failures += 1
                log.debug("trimming the WAL failed: %r", exc, extra={"action": "trim_failed"})
            await self._pause(self.config.trim_interval_s)

    async def _read_backlog(self) -> None:
        consumer = await self.wal.consumer_state()
        first = consumer.ack_floor + 1
        last = min(consumer.last_seq, first + BACKLOG_SCAN_LIMIT - 1)
        assert self._thread_log is not None
        tail = await self._thread_log.read_tail(first, last)
        stats = self._stats
        stats.consumer_pending = consumer.num_pending
        stats.consumer_ack_pending = consumer.num_ack_pending
        stats.consumer_redelivered = consumer.num_redelivered
        stats.backlog = stats.consumer_pending + stats.consumer_ack_pending
        stats.pending_threads = len({e.thread_id for e in tail})
        oldest = min((e.at for e in tail), default=None)
        now = self.clock()
        stats.oldest_pending_age_s = (
            max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0
        )
        stats.backlog_polled_at = now.timestamp()

    # -- the loop --------------------------------------------------------------------------

    async def _drain_loop(self) -> None:
        """Collect a window, hand it to a cycle task, and collect the next window while
        that cycle applies and settles.

        At most one cycle runs at a time: the next starts only once the previous has
        settled everything it held, so every thread's entries are applied in WAL order
        and no thread is ever in two transactions of this flusher at once. Only the
        fetching overlaps the apply.
        """
        assert self._intake is not None
        intake = self._intake
        keepalive = asyncio.create_task(self._keepalive(), name=f"{self.name}-keepalive")
        self._cpu_mark = time.process_time()

        def busy() -> bool:
            return self._running is not None and not self._running.done()

        try:
            fetch_failures = 0
            while not self._stop.is_set():
                overlapped = busy()
                try:
                    await intake.collect(self._stop.is_set, busy)
                except Exception as exc:
                    fetch_failures += 1
                    await self._fetch_failed(exc, fetch_failures)
                    continue
                if fetch_failures:
                    log.info(
                        "fetching from the WAL works again",
                        extra={"action": "fetch_recovered", "failures": fetch_failures},
                    )
                    fetch_failures = 0
                if self._running is not None:
                    # Raises only CancelledError (`stop` cancelled the cycle): the
                    # messages in hand are then given back below.
                    await self._running
                    self._running = None
                msgs = intake.take()
                if msgs:
                    if overlapped:
                        self._stats.overlapped_cycles += 1
                    self._running = asyncio.create_task(
                        self._cycle(msgs), name=f"{self.name}-cycle"
                    )
                self._tick.set()
            if self._running is not None:
                await self._running
        finally:
            running, self._running = self._running, None
            # Cancelled (stop without drain, or the drain timed out): the cycle gives its
            # messages back itself; those collected for the next one go back here.
            if running is not None and not running.done():
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
            await self._runner_settler().all(
                [Held(m) for m in [*intake.take(), *intake.queued()]],
                Settle.NAK,
                self.config.requeue_delay_s,
            )
            await cancel_and_wait(keepalive)
            with contextlib.suppress(asyncio.CancelledError):
                await keepalive
            self._count_cpu()
            self._tick.set()

    async def _restore_consumer(self) -> None:
        """After a failed fetch, re-create the durable consumer if someone deleted it
        (otherwise every later fetch fails and nothing is flushed again)."""
        assert self._intake is not None
        try:
            await self._intake.restore_consumer()
        except WalUnavailableError:
            pass  # NATS itself is away: the fetch failure is logged already
        except (ConfigError, WalObjectMissingError, WalRefusedError) as exc:
            # The consumer conflicts with its settings, its stream is gone, or JetStream
            # refuses to create it: counted and logged; the loop tries again later.
            self._stats.consumer_restore_failures += 1
            log.error(
                "the durable consumer %r is missing and cannot be created: %s",
                self.config.consumer_name,
                exc,
                extra={"action": "consumer_recreate_failed"},
            )

    async def _fetch_failed(self, exc: Exception, failures: int) -> None:
        self._stats.nats_errors += 1
        if failures == 1:
            log.warning("fetching from the WAL failed: %r", exc, extra={"action": "fetch_failed"})
        await self._restore_consumer()
        await self._pause(
            backoff_s(
                failures,
                initial_s=self.config.nats_retry_initial_s,
                max_s=self.config.nats_retry_max_s,
            )
        )

    async def _cycle(self, msgs: list[Delivered]) -> None:
        """Run one cycle; after a failed one, pause (longer after each in a row) before
        the next may start."""
        assert self._runner is not None
        try:
            await self._runner.run(msgs)
            self._cycle_failures = 0
        except Exception:
            self._cycle_failures += 1
            self._stats.cycle_errors += 1
            log.exception(
                "flush cycle failed; its messages were given back", extra={"action": "cycle_failed"}
            )
            await self._pause(
                backoff_s(
                    self._cycle_failures,
                    initial_s=self.config.nak_delay_initial_s,
                    max_s=self.config.nak_delay_max_s,
                )
            )
        finally:
            self._count_cpu()

    def _count_cpu(self) -> None:
        """Add the process CPU time since the last count to `cpu_s`."""
        now = time.process_time()
        self._stats.cpu_s += now - self._cpu_mark
        self._cpu_mark = now

    def _runner_settler(self) -> Settler:
        assert self._runner is not None
        return self._runner.settler

    @property
    def _holding(self) -> bool:
        """Whether this flusher holds messages (in a cycle, or collected for the next)."""
        in_hand = self._intake.in_hand if self._intake is not None else []
        held = self._runner.held if self._runner is not None else []
        return bool(in_hand or held)

    async def _keepalive(self) -> None:
        """Send in-progress acks for held messages every ack_wait/3, those of the running
        cycle, those collected for the next and those delivered to the subscription and
        not fetched yet, so a slow apply or a database outage does not get them
        redelivered to another flusher."""
        assert self._runner is not None
        assert self._intake is not None
        while True:
            await asyncio.sleep(self.config.ack_wait_s / 3)
            waiting = [Held(m) for m in [*self._intake.in_hand, *self._intake.queued()]]
            for held in [*self._runner.held, *waiting]:
                if not held.settled:
                    with contextlib.suppress(Exception):
                        await held.msg.in_progress()

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake up at once when asked to stop."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
