"""How large a statement may be to go through a psycopg pipeline, and how to split
large column arrays so that their statements stay below that.

psycopg (3.3, async, with libpq 18) in pipeline mode does not send a statement whose
message is larger than about 7 MB: the pipeline waits for results that never come,
while the server waits for the statement ("idle in transaction", holding every lock the
transaction took). Measured on this project's machines: one ``bytea`` parameter of
7 MB goes and one of 8 MB hangs, in one statement or among others; several 3 MB
statements in one pipeline go; outside pipeline mode 200 MB go. So the flush paths keep
every pipelined statement below `MESSAGE_LIMIT`: they split their column arrays into
chunks of at most `CHUNK_BYTES` (`chunks`), and a pipeline that would still hold a
larger statement (one row alone above the limit) is sent one statement at a time
outside pipeline mode (`fits_pipeline`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MESSAGE_LIMIT = 4 * 1024 * 1024
"""The largest statement (its parameters' bytes, estimated by `payload_bytes`) sent in
pipeline mode: about half of what was seen to hang."""

CHUNK_BYTES = 2 * 1024 * 1024
"""The parameter bytes a chunk of rows aims at (`chunks`)."""


def payload_bytes(value: Any) -> int:
    """An upper bound of the bytes `value` takes as statement parameters: bytes as they
    are, text at four bytes a character unless it is ASCII, arrays and mappings as the
    sum of their items, anything else as eight."""
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if isinstance(value, str):
        return len(value) if value.isascii() else 4 * len(value)
    if isinstance(value, list | tuple):
        return sum(payload_bytes(item) for item in value)
    if isinstance(value, Mapping):
        return sum(payload_bytes(item) for item in value.values())
    return 8


def fits_pipeline(params: Iterable[Any]) -> bool:
    """Whether every statement of these parameters (one item per statement) is small
    enough to be sent in pipeline mode."""
    return all(payload_bytes(p) <= MESSAGE_LIMIT for p in params)


def chunks(sizes: Sequence[int], limit: int = CHUNK_BYTES) -> list[range]:
    """Consecutive ranges of row indices, each holding rows whose sizes add up to at
    most `limit` (a row larger than `limit` makes a range of its own); every row is in
    exactly one range, in order."""
    out: list[range] = []
    start = 0
    total = 0
    for index, size in enumerate(sizes):
        if index > start and total + size > limit:
            out.append(range(start, index))
            start, total = index, 0
        total += size
    if sizes:
        out.append(range(start, len(sizes)))
    return out
