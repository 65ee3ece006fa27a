"""docs/quickstart.md works as written: its script, run as a user runs it (its own
process, the URLs in ``NATS_URL``/``DATABASE_URL``), prints exactly the output the page
shows.

The test only adds ``BUFSTORE_*`` variables (which the script reads as documented) so it
writes to this test's own schema, stream and buckets.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from buffered_store.config import BufferedStoreConfig
from buffered_store.stores.urls import to_libpq_url

pytestmark = pytest.mark.integration

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"


def script_and_output() -> tuple[str, str]:
    """The page's one Python block and the ``text`` block it says the script prints."""
    text = QUICKSTART.read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    python = [i for i, (lang, _) in enumerate(blocks) if lang == "python"]
    assert len(python) == 1, "the quickstart has one script"
    lang, output = blocks[python[0] + 1]
    assert lang == "text", "the script's output follows it"
    return blocks[python[0]][1], output


async def test_the_quickstart_script_prints_what_the_page_shows(
    tmp_path: Path, database_url: str, schema_name: str, config: BufferedStoreConfig
) -> None:
    script, expected = script_and_output()
    (tmp_path / "quickstart.py").write_text(script)
    env = {
        **os.environ,
        "NATS_URL": config.nats_url,
        "DATABASE_URL": database_url,
        "BUFSTORE_SCHEMA": schema_name,
        "BUFSTORE_STREAM_NAME": config.stream_name,
        "BUFSTORE_HOT_BUCKET": config.hot_bucket,
        "BUFSTORE_QUARANTINE_BUCKET": config.quarantine_bucket,
        "BUFSTORE_CONSUMER_NAME": config.consumer_name,
    }
    try:
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "quickstart.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert done.returncode == 0, done.stderr[-6000:]
        assert done.stdout == expected
    finally:
        async with await psycopg.AsyncConnection.connect(
            to_libpq_url(database_url), autocommit=True
        ) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema_name}" CASCADE')
