"""A checkpointing process: ``python tests/e2e/procs/writer.py NAME THREAD COUNT``.

Opens its own `BufferedThreadRunStore` (configured by ``BUFSTORE_*`` variables, inner
store Postgres at ``DATABASE_URL`` / ``BUFSTORE_TEST_SCHEMA``), prints ``ready``, waits for
a line on stdin (so several writers start together), then makes COUNT checkpoints of
THREAD, each with a snapshot and run that identify the writer and the step
(`snapshot(name, step)`, run id ``run-NAME``, ``steps=step``). It prints one JSON line per
acknowledged checkpoint ``{"seq": ..., "step": ...}`` and ``{"error": ...}`` for others,
then ``done``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from buffered_store.config import BufferedStoreConfig
from buffered_store.errors import StoreError
from buffered_store.model.records import Message
from buffered_store.stores.postgres import PostgresThreadRunStore
from buffered_store.testing import make_run
from buffered_store.threadrun.store import BufferedThreadRunStore


def snapshot(name: str, step: int) -> list[Message]:
    """The messages writer `name` checkpoints at `step` (its length varies with the step)."""
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{name}:{step}:{i}"}
        for i in range(1 + step % 5)
    ]


async def main(name: str, thread_id: str, count: int) -> int:
    inner = await PostgresThreadRunStore.connect(
        os.environ["DATABASE_URL"], schema=os.environ["BUFSTORE_TEST_SCHEMA"]
    )
    config = BufferedStoreConfig.from_env(drain_on_close=False)
    store = await BufferedThreadRunStore.connect(inner, config)
    try:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        run = make_run(thread_id, run_id=f"run-{name}")
        for step in range(1, count + 1):
            try:
                receipt = await store.checkpoint(
                    thread_id, snapshot(name, step), run.replace(steps=step)
                )
            except StoreError as exc:
                print(json.dumps({"step": step, "error": repr(exc)}), flush=True)
                continue
            print(json.dumps({"seq": receipt.thread_seq, "step": step}), flush=True)
        print(json.dumps({"stats": store.stats()}), flush=True)
    finally:
        await store.close()
        await inner.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
