"""`buffered_store.engine.keys`: thread ids of any Unicode become safe NATS tokens, and back."""

from __future__ import annotations

import random
import re

import pytest

from buffered_store.engine.keys import (
    decode_token,
    encode_token,
    flushed_key,
    hot_key,
    msg_id,
    stream_subjects,
    thread_from_subject,
    thread_token,
    wal_subject,
)
from buffered_store.errors import ValidationError
from buffered_store.threadrun.claims import run_key

TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")

IDS = [
    "t",
    "thread-1",
    ".",
    "..",
    "a.b.c",
    "*",
    ">",
    "a.*.>",
    " ",
    "with spaces ",
    "tab\tnew\nline",
    "🧵",
    "שלום עולם",
    "مرحبا",
    "日本語",
    "$KV.thread-hot.h",
    "%_",
    "é" * 256,  # the longest ids: MAX_ID_BYTES (512) UTF-8 bytes
    "🧵" * 128,
    "\u200b",
    "e\u0301",
]


def _random_ids(count: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(1, 0x3000) if not 0xD800 <= c <= 0xDFFF]
    alphabet += [".", "*", ">", " ", "🧵", "\U0010ffff"]
    return ["".join(rng.choices(alphabet, k=rng.randint(1, 40))) for _ in range(count)]


@pytest.mark.parametrize("thread_id", IDS + _random_ids(200))
def test_tokens_round_trip_and_use_a_safe_alphabet(thread_id: str) -> None:
    token = encode_token(thread_id)
    assert TOKEN.match(token), token
    assert decode_token(token) == thread_id
    assert thread_token(thread_id) == token


def test_distinct_ids_give_distinct_tokens() -> None:
    ids = IDS + _random_ids(500, seed=11)
    assert len({encode_token(i) for i in set(ids)}) == len(set(ids))


@pytest.mark.parametrize("thread_id", IDS)
def test_subject_round_trip(thread_id: str) -> None:
    subject = wal_subject("THREADLOG", thread_id)
    assert subject.split(".")[:2] == ["THREADLOG", "t"]
    assert len(subject.split(".")) == 3
    assert not any(c in subject for c in "*> \t\n")
    assert thread_from_subject("THREADLOG", subject) == thread_id


@pytest.mark.parametrize(
    "subject",
    [
        "OTHER.t.dA",
        "THREADLOG.x.dA",
        "THREADLOG.t.",
        "THREADLOG.t.dA.extra",
        "THREADLOG.t.a",  # not valid base64
        "THREADLOG.t._w",  # base64 of b"\xff": not UTF-8
        "THREADLOG",
        "THREADLOGX.t.dA",
    ],
)
def test_thread_from_subject_rejects_foreign_subjects(subject: str) -> None:
    assert thread_from_subject("THREADLOG", subject) is None


@pytest.mark.parametrize("token", ["a", "_w", "é", "d!A=", "dA!!"])
def test_decode_token_rejects_garbage(token: str) -> None:
    with pytest.raises(ValidationError):
        decode_token(token)


@pytest.mark.parametrize("token", ["!!!!", "fn5+", "dA=", "dA=="])
def test_decode_token_rejects_non_canonical_tokens(token: str) -> None:
    # SPINE BUG (minor): base64 decoding ignores characters outside the alphabet and
    # accepts the standard alphabet, so several tokens decode to the same id ("!!!!" to
    # ""); the fix is to require encode_token(decoded) == token.
    with pytest.raises(ValidationError):
        decode_token(token)


def test_kv_keys_and_msg_ids() -> None:
    token = encode_token("a.b")
    assert hot_key("a.b") == f"h.{token}"
    assert flushed_key("a.b") == f"f.{token}"
    assert run_key("r.1") == f"r.{encode_token('r.1')}"
    assert msg_id("a.b", 7) == f"{token}:7"
    assert msg_id("a.b", 7) != msg_id("a.b", 8) != msg_id("a.c", 7)
    assert stream_subjects("THREADLOG") == "THREADLOG.>"


@pytest.mark.parametrize("bad", ["", "x" * 513, "nul\x00"])
def test_invalid_ids_are_rejected(bad: str) -> None:
    for make in (thread_token, hot_key, flushed_key, run_key):
        with pytest.raises(ValidationError):
            make(bad)
    with pytest.raises(ValidationError):
        wal_subject("S", bad)


def test_lone_surrogate_id_is_a_validation_error() -> None:
    # SPINE BUG: check_id accepts lone surrogates; encoding then raises UnicodeEncodeError
    # (not a StoreError) in the buffered store, and psycopg fails on them too.
    with pytest.raises(ValidationError):
        thread_token("bad\ud800id")


def test_cached_translations_stay_correct_and_bounded() -> None:
    from buffered_store.engine import keys

    ids = _random_ids(keys._CACHED_THREADS + 500, seed=12)
    for _ in range(2):  # the second pass partly hits, partly misses the caches
        for thread_id in ids:
            subject = wal_subject("THREADLOG", thread_id)
            assert thread_from_subject("THREADLOG", subject) == thread_id
            assert thread_from_subject("OTHER", subject) is None
    assert keys._thread_from_subject.cache_info().currsize <= keys._CACHED_THREADS
    assert keys._thread_token.cache_info().currsize <= keys._CACHED_THREADS


@pytest.mark.parametrize("bad", ["", "a\x00b", 5, None, ["t"]])
def test_invalid_thread_ids_are_rejected_on_every_call(bad: object) -> None:
    for _ in range(2):  # a failed validation is never remembered as a token
        with pytest.raises(ValidationError):
            thread_token(bad)  # type: ignore[arg-type]
        with pytest.raises(ValidationError):
            flushed_key(bad)  # type: ignore[arg-type]
