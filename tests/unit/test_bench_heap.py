"""`benchmarks.measure.settle_harness_heap`: run in a child interpreter, since it changes
the whole process's collector (the test process keeps its own)."""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = """
import gc, json, weakref
from benchmarks.measure import settle_harness_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)

kept = [Node() for _ in range(5_000)]   # an earlier side's results, still referenced
first_garbage = cycle()[1]               # an earlier side's cyclic garbage
held, frozen_cycle = cycle()             # alive when frozen, garbage once dropped
first = settle_harness_heap()
kept_frozen = gc.get_freeze_count()
leftover = cycle()[1]                    # garbage of the side measured after the freeze
del kept, held                           # its results dropped before the next side
second = settle_harness_heap()
print(json.dumps({
    "first": first,
    "kept_frozen": kept_frozen,
    "first_garbage_freed": first_garbage() is None,
    "leftover_freed": leftover() is None,
    "frozen_cycle_freed": frozen_cycle() is None,
    "second": second,
    "after_second": gc.get_freeze_count(),
}))
"""


def test_settle_harness_heap_frees_garbage_then_freezes_and_does_not_carry_over() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # Garbage made before a phase is freed, not frozen with the live objects.
    assert report["first_garbage_freed"] is True
    assert report["first"] == report["kept_frozen"] > 5_000
    # The next phase's settle undoes the freeze first: a cycle made after the first
    # freeze is collected, and so is one that was frozen alive and dropped since (a
    # frozen cycle is never examined, so without the unfreeze it would leak).
    assert report["leftover_freed"] is True
    assert report["frozen_cycle_freed"] is True
    assert report["second"] == report["after_second"]
    assert report["second"] < report["first"] - 4_000
