"""The garbage collector of a flusher process (`bufstore flusher`, `python -m flusher`).

A cycle builds a few objects per entry (its message, its decoded entry, its run) and
keeps them until the cycle is settled, so each cycle's objects outlive the young
generation and pile up in the old one, whose full collections then walk everything the
process holds: the modules, classes and functions of nats-py, psycopg, SQLAlchemy and
the store, which are never garbage. Measured in the `raw` benchmark's flusher (64
threads, about 1,000 entries a cycle): the collector took about 9 µs of the flusher's
62 µs of CPU per entry; after `settle_heap` about 3 µs.

`settle_heap` freezes what the process holds once the flusher has started (`gc.freeze`:
those objects are never examined again; they are not freed either, which they would not
be anyway) and collects the young generation every `YOUNG_THRESHOLD` allocations
instead of CPython's 700 (a cycle's objects are freed by reference counting as soon as
it is settled; the collector finds only reference cycles, which are rare here). Only a
process that is a flusher calls it: these settings are the whole process's, and an
application that embeds a `Flusher` keeps its own.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("flusher.heap")

YOUNG_THRESHOLD = 10_000
"""Allocations (net of deallocations) between two collections of the young generation."""


def settle_heap() -> int:
    """Freeze the objects the process holds now and collect the young generation less
    often; returns how many objects were frozen. Call it once start-up is over."""
    gc.collect()  # what start-up left as garbage is freed, not frozen
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    frozen = gc.get_freeze_count()
    log.info(
        "garbage collector settled: %d start-up objects frozen, young generation every "
        "%d allocations",
        frozen,
        max(young, YOUNG_THRESHOLD),
        extra={"action": "heap_settled", "frozen_objects": frozen},
    )
    return frozen
