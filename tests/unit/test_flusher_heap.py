"""`flusher.heap.settle_heap`: run in a child interpreter, since it changes the whole
process's collector (the test process keeps its own)."""

from __future__ import annotations

import json
import subprocess
import sys

from flusher.heap import YOUNG_THRESHOLD

_CHILD = """
import gc, json, weakref
import flusher.service  # what a flusher process holds by the time it runs
from flusher.heap import settle_heap

before = gc.get_threshold()
frozen = settle_heap()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle made after start-up
alive = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({
    "frozen": frozen,
    "freeze_count": gc.get_freeze_count(),
    "before": before,
    "after": gc.get_threshold(),
    "cycle_collected": alive() is None,
}))
"""


def test_settle_heap_freezes_start_up_objects_and_still_collects_later_cycles() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # The modules of a flusher are thousands of objects; all of them are set aside.
    assert report["frozen"] > 10_000
    assert report["frozen"] == report["freeze_count"]
    assert report["after"][0] == max(report["before"][0], YOUNG_THRESHOLD)
    assert report["after"][1:] == report["before"][1:]
    # Garbage made after start-up is still found and freed.
    assert report["cycle_collected"] is True
