"""What Postgres (or the WAL's JSON) would refuse, refused before anything is written. Pure.

AsyncPostgresSaver finds out at the INSERT; this front-end writes to the WAL first and
to Postgres later, in the flusher, where a refused row would be a poison entry. So every
text and JSON value that goes into a ``text`` or ``jsonb`` column is checked here, and
the `ValidationError` names where the bad value sits (``metadata.deep.k``,
``checkpoint.channel_values.items[2]``).
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from buffered_store.errors import ValidationError
from buffered_store.langgraph.entry import KEY_LIMITS

INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
"""The integers the WAL's JSON encoder (orjson) writes; Postgres jsonb would take larger
ones, so this is our limit, not Postgres's (AsyncPostgresSaver accepts them)."""


def check_text(value: Any, what: str) -> str:
    """`value` if it is a string Postgres ``text`` accepts (no NUL, valid Unicode)."""
    if not isinstance(value, str):
        raise ValidationError(f"{what} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise ValidationError(f"{what} contains a NUL character, which Postgres text rejects")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{what} is not valid Unicode (lone surrogate)") from None
    return value


def check_key(value: Any, what: str) -> str:
    """`value` if it is a key Postgres can index: `check_text`, and at most its kind's
    limit of UTF-8 bytes (`entry.KEY_LIMITS`; longer keys would make Postgres refuse
    the index row at flush time, long after the write was acknowledged)."""
    text = check_text(value, what)
    limit = KEY_LIMITS[what]
    if len(text) > limit // 4:  # only a long string can be too long in bytes
        size = len(text.encode("utf-8"))
        if size > limit:
            raise ValidationError(
                f"{what} is {size} bytes in UTF-8; at most {limit} fit a Postgres index row"
            )
    return text


def json_bytes(value: Any, where: str) -> bytes:
    """The JSON text of `value`, refusing what `check_json` refuses.

    orjson itself refuses most of it (integers beyond 64 bits, lone surrogates,
    non-string keys, most other types). What it takes but `check_json` would not comes
    out as ``\\u0000`` (a NUL), or reads back as another value: NaN and Infinity
    written as null, and orjson's own types (datetime, UUID, dataclass, enum) written as
    strings or objects. A value that reads back equal and holds no NUL is then valid,
    for the cost of one parse (a LangGraph checkpoint's: about a quarter of the walk in
    Python, which every put paid twice); any other value gets `check_json`, which names
    the path of what is wrong (or lets it pass: a tuple reads back as a list).
    """
    try:
        data: bytes | None = orjson.dumps(value)
    except TypeError:
        data = None
    if data is not None and b"\\u0000" not in data and orjson.loads(data) == value:
        return data
    check_json(value, where)
    if data is not None:
        return data
    try:
        return orjson.dumps(value)
    except TypeError as exc:  # check_json names the path of anything orjson refuses
        raise ValidationError(f"{where} cannot be encoded as JSON: {exc}") from exc


def check_json(value: Any, where: str) -> None:
    """Refuse what Postgres jsonb or the WAL refuses: NUL in strings or keys,
    NaN/Infinity, lone surrogates, integers beyond 64 bits, non-string keys, non-JSON
    types. Iterative, so deeply nested values do not hit the recursion limit."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                raise ValidationError(
                    f"{path} is an integer beyond 64 bits ({item.bit_length()} bits), "
                    "which the WAL's JSON cannot carry; store it as a string"
                )
        elif isinstance(item, str):
            check_text(item, path)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValidationError(f"{path} is {item!r}; Postgres jsonb has no NaN/Infinity")
        elif isinstance(item, dict):
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise ValidationError(f"{path} has a non-string key {key!r}")
                check_text(key, f"{path} key {key!r}")
                stack.append((sub, f"{path}.{key}"))
        elif isinstance(item, list | tuple):
            stack.extend((sub, f"{path}[{i}]") for i, sub in enumerate(item))
        else:
            raise ValidationError(f"{path} is a {type(item).__name__}, not JSON")
