"""What the figures were measured on: machine, versions, server settings."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import nats
import psutil

from buffered_store.dev.services import find_nats_server

PACKAGES = (
    "buffered-thread-store",
    "nats-py",
    "sqlalchemy",
    "psycopg",
    "orjson",
    "pyspark",
    "matplotlib",
    "psutil",
)


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or the platform's guess)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """Cores, memory, CPU model, OS and Python."""
    return {
        "hostname": platform.node(),
        "cpu_model": cpu_model(),
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
    }


SPEED_LOOP_ADDITIONS = 3_000_000
SPEED_WAKES = 200
SPEED_SLEEP_S = 0.005


async def speed() -> dict[str, float]:
    """How fast this machine runs right now, for comparing runs of different days: the
    seconds a plain-Python loop of 3 million additions takes, and the CPU microseconds
    an event loop spends per wake-up from a 5 ms sleep (measured over 200, about a
    second). On a virtual machine every wake-up from idle costs a core that CPU, so
    at low load it weighs on each figure that waits for a reply (a step's round trip,
    a background timer) as much as the work in Python does."""
    began = time.perf_counter()
    total = 0
    for i in range(SPEED_LOOP_ADDITIONS):
        total += i
    loop_s = time.perf_counter() - began
    cpu = time.process_time()
    for _ in range(SPEED_WAKES):
        await asyncio.sleep(SPEED_SLEEP_S)
    wake_us = (time.process_time() - cpu) / SPEED_WAKES * 1e6
    return {"python_loop_s": round(loop_s, 3), "wake_cpu_us": round(wake_us, 1)}


def versions() -> dict[str, Any]:
    """Versions of the packages that shape the figures, and the git commit."""
    out: dict[str, Any] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["nats-py-module"] = getattr(nats, "__version__", None)
    out["git_commit"] = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    out["git_dirty"] = bool(status) if status is not None else None
    return out


def nats_server_version() -> str | None:
    """`nats-server --version` of the binary dev-services start."""
    try:
        binary = find_nats_server()
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10
        )
    except Exception:
        return None
    return (done.stdout or done.stderr).strip() or None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent.parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
