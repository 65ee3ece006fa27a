"""The wheel as a user installs it: built from the sources, installed into a fresh venv,
then ``bufstore db upgrade``, ``bufstore bench`` and a checkpoint run from the installed
package against the test services.

The repository keeps ``migrations/`` and ``benchmarks/`` at the top level, but the wheel
must install them under ``buffered_store``: top-level packages of those names clash with
other projects (every Django app has ``migrations``).

Offline and fast: the wheel is built with the dev venv's own setuptools
(``--no-build-isolation --no-index``) and installed with ``--no-deps``; the fresh venv
borrows the third-party dependencies from the dev venv through a ``.pth`` line. A line
in a ``.pth`` file only appends a directory to ``sys.path`` (the ``.pth`` files inside it,
such as the dev venv's editable-install hook, are not run), and the fresh venv's own
site-packages comes first, so every project module imported here is the installed one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from buffered_store.config import BufferedStoreConfig
from buffered_store.stores.urls import to_libpq_url

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DIST = "buffered-thread-store"
SOURCES = ("buffered_store", "flusher", "migrations", "benchmarks")
IMPORT_PACKAGES = {"buffered_store", "flusher"}
"""The only top-level import packages the wheel may install."""

CHECKPOINT_SCRIPT = """
import asyncio, json, sys

import buffered_store
import buffered_store.migrations
from buffered_store import BufferedStoreConfig, BufferedThreadRunStore, PostgresThreadRunStore
from buffered_store import RunRecord

async def main(database_url, schema, settings):
    inner = await PostgresThreadRunStore.connect(database_url, schema=schema)
    try:
        config = BufferedStoreConfig(**settings)
        async with BufferedThreadRunStore.connect(inner, config) as store:
            run = RunRecord(run_id="wheel-run", thread_id="wheel-t", agent_id="wheel")
            messages = [{"role": "user", "content": "from the wheel"}]
            receipt = await store.checkpoint("wheel-t", messages, run)
            flushed = await store.force_flush("wheel-t")
    finally:
        await inner.close()
    print(json.dumps({
        "buffered_store": buffered_store.__file__,
        "migrations": buffered_store.migrations.__file__,
        "thread_seq": receipt.thread_seq,
        "flushed_seq": flushed,
    }))

asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
"""


@dataclass(frozen=True)
class Installed:
    """A fresh venv with the project's wheel installed."""

    python: Path
    bufstore: Path
    site_packages: Path
    workdir: Path
    """Where commands run: outside the repository, so nothing is imported from it."""
    env: dict[str, str]


def run(args: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command; fail the test with its output when it fails."""
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Build the wheel from a copy of the sources and install it into a fresh venv."""
    base = tmp_path_factory.mktemp("wheel")
    # A copy, so the build's egg-info and build/ never land in (or race in) the checkout.
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in SOURCES:
        shutil.copytree(
            ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "results")
        )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    offline = ["-q", "--no-deps", "--no-index"]
    run([*pip, "wheel", *offline, "--no-build-isolation", "-w", base / "dist", src], cwd=base)
    (wheel,) = (base / "dist").glob("buffered_thread_store-*.whl")

    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=base)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    run([*pip, "--python", python, "install", *offline, wheel], cwd=base)
    site_packages = Path(
        run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=base
        ).strip()
    )
    dev_libs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site_packages / "_dev_dependencies.pth").write_text("\n".join(sorted(dev_libs)) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    workdir = base / "work"
    workdir.mkdir()
    return Installed(python, python.parent / "bufstore", site_packages, workdir, env)


def test_the_wheel_installs_no_top_level_migrations_or_benchmarks(installed: Installed) -> None:
    shown = run(
        [sys.executable, "-m", "pip", "--python", installed.python, "show", "-f", DIST],
        cwd=installed.workdir,
        env=installed.env,
    )
    location = next(line for line in shown.splitlines() if line.startswith("Location:"))
    assert Path(location.split(":", 1)[1].strip()) == installed.site_packages
    files = {
        line.strip()
        for line in shown.split("Files:", 1)[1].splitlines()
        if line.strip() and not line.strip().startswith("..")  # scripts: ../../../bin/...
    }
    top_level = {f.split("/", 1)[0] for f in files if "/" in f and ".dist-info/" not in f}
    assert top_level == IMPORT_PACKAGES, f"top-level packages in the wheel: {sorted(top_level)}"
    assert {
        "buffered_store/migrations/env.py",
        "buffered_store/migrations/script.py.mako",
        "buffered_store/migrations/versions/0001_initial.py",
        "buffered_store/benchmarks/cli.py",
        "buffered_store/benchmarks/scenarios/hot_threads.py",
        "buffered_store/py.typed",
        "flusher/py.typed",
    } <= files


def test_bufstore_bench_works_from_the_wheel(installed: Installed) -> None:
    # The scenario list is built from `buffered_store.benchmarks.scenarios` modules found
    # in the installed package; a broken `bench` plugin would be missing from bufstore.
    out = run([installed.bufstore, "bench", "--help"], cwd=installed.workdir, env=installed.env)
    assert "hot-threads" in out
    assert "spark-overlay" in out


async def test_db_upgrade_and_a_checkpoint_from_the_wheel(
    installed: Installed, database_url: str, schema_name: str, config: BufferedStoreConfig
) -> None:
    try:
        out = await asyncio.to_thread(
            run,
            [installed.bufstore, "db", "upgrade", "--url", database_url, "--schema", schema_name],
            cwd=installed.workdir,
            env=installed.env,
        )
        assert f"schema {schema_name!r} is at revision 0001" in out

        settings = {
            "nats_url": config.nats_url,
            "stream_name": config.stream_name,
            "hot_bucket": config.hot_bucket,
            "quarantine_bucket": config.quarantine_bucket,
            "consumer_name": config.consumer_name,
        }
        script = installed.workdir / "checkpoint.py"
        script.write_text(CHECKPOINT_SCRIPT)
        out = await asyncio.to_thread(
            run,
            [installed.python, script, database_url, schema_name, json.dumps(settings)],
            cwd=installed.workdir,
            env=installed.env,
        )
        result = json.loads(out.strip().splitlines()[-1])
        assert Path(result["buffered_store"]).is_relative_to(installed.site_packages)
        assert Path(result["migrations"]).is_relative_to(installed.site_packages)
        assert result["thread_seq"] == 1
        assert result["flushed_seq"] == 1

        async with await psycopg.AsyncConnection.connect(to_libpq_url(database_url)) as conn:
            cursor = await conn.execute(
                f'SELECT message FROM "{schema_name}".messages WHERE thread_id = %s',
                ("wheel-t",),
            )
            rows = await cursor.fetchall()
        assert [row[0]["content"] for row in rows] == ["from the wheel"]
    finally:
        async with await psycopg.AsyncConnection.connect(
            to_libpq_url(database_url), autocommit=True
        ) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema_name}" CASCADE')
