"""Run claims: which thread owns a run id, in the hot bucket (``r.<run id>``). Pure.

A run id belongs to one thread; the first checkpoint of a run claims it with a
compare-and-set on its key, so a second thread reusing the id is refused
(`RunOwnershipError`) before anything is written.
"""

from __future__ import annotations

from buffered_store.engine.ids import check_id
from buffered_store.engine.keys import encode_token


def run_key(run_id: str) -> str:
    """KV key of a run's claim: which thread owns the run id (see `encode_run_claim`)."""
    return f"r.{encode_token(check_id(run_id, 'run_id'))}"


def encode_run_claim(thread_id: str, claimed_at_us: int, seq: int) -> bytes:
    """KV value of a run claim: the owning thread, when it was claimed (µs since the
    epoch, the claimer's clock) and the thread's seq the claimer knew then, joined by
    NULs, which ids never contain."""
    return f"{thread_id}\x00{claimed_at_us}\x00{seq}".encode()


def decode_run_claim(value: bytes) -> tuple[str, int, int | None]:
    """(thread id, claimed at µs, thread seq) of a run claim. Claims written before the
    time was recorded (the bare thread id) read as claimed at 0, i.e. long ago; claims
    without a seq read None (unknown)."""
    text = value.decode("utf-8")
    thread_id, sep, rest = text.partition("\x00")
    if not sep:
        return text, 0, None
    at, sep, seq = rest.partition("\x00")
    try:
        claimed_at = int(at)
    except ValueError:
        return thread_id, 0, None
    try:
        return thread_id, claimed_at, int(seq) if sep else None
    except ValueError:
        return thread_id, claimed_at, None
