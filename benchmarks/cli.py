"""`bufstore bench SCENARIO [options]` (and `python -m buffered_store.benchmarks`).

Registered on the `bufstore` command line through the ``bufstore.commands`` entry-point
group, so `buffered_store` never imports this package (which imports the flusher).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import nats

from . import PACKAGE, report
from .harness import Bench, Options
from .machine import machine, nats_server_version, speed, versions
from .scenarios import MODULES, load


def register(main: click.Group) -> None:
    """Add `bench` to the `bufstore` group."""
    main.add_command(bench)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks: the buffered store against the direct Postgres store, side by side.

    Each scenario starts its own NATS and Postgres (unless URLs are given), runs both
    sides in the same invocation and writes results.json, report.md and PNG plots to a
    results folder (default benchmarks/results/<timestamp>-<scenario>/).
    """


def _scenario_command(name: str) -> click.Command:
    description, _ = load_description(name)

    @click.command(name=name, help=description)
    @click.option("--quick", is_flag=True, help="Seconds and small sizes (a smoke test).")
    @click.option("--output", type=click.Path(path_type=Path), default=None, help="Results folder.")
    @click.option("--nats-url", default=None, help="Use this NATS server (default: start one).")
    @click.option(
        "--database-url", default=None, help="Use this Postgres server (default: start one)."
    )
    @click.option("--duration-s", type=float, default=None, help="Measured seconds per side.")
    @click.option("--threads", type=int, default=None, help="Concurrent threads (writers).")
    @click.option(
        "--rate", type=float, default=None, help="Checkpoints/s per thread (paced scenarios)."
    )
    @click.option(
        "--api",
        type=click.Choice(["checkpoint", "append"]),
        default=None,
        help="Store call of each step, on every side: checkpoint (full snapshot) or append "
        "(the new messages only). Default: append for curve, checkpoint elsewhere.",
    )
    @click.option("--steps", type=int, default=None, help="Graph steps per run (langgraph).")
    @click.option(
        "--runs", type=int, default=None, help="Graph runs per thread, in turn (langgraph)."
    )
    @click.option(
        "--db-delay-ms",
        type=click.FloatRange(min=0.0),
        default=None,
        help="Round trip (ms) a delaying proxy adds to every Postgres connection of the "
        "sides, D/2 each way; NATS stays local (langgraph, saturate).",
    )
    @click.option(
        "--hot-linger-s",
        type=click.FloatRange(min=0.0, max=10.0),
        default=None,
        help="hot_linger_s of the thread-run store on every buffered side: hot records "
        "advanced in the background that many seconds after a checkpoint (default: before "
        "checkpoint() returns).",
    )
    @click.option(
        "--floor-rounds",
        type=click.IntRange(min=1, max=20),
        default=None,
        help="hot-threads: run the durable write path alone and the raw loop that many "
        "times, in turn (ABBA order), to show the fsync floor's own spread (default 1).",
    )
    @click.option("--keep", is_flag=True, help="Keep the side databases and WAL streams.")
    @click.option(
        "--profile",
        is_flag=True,
        help="cProfile the writers and the flusher (slower: the timings are not the figures).",
    )
    def command(**kwargs: Any) -> None:
        # Background jobs start with SIGINT ignored; both signals must unwind the run so
        # that the servers it started are stopped and its databases dropped.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _interrupt)
        options = Options(command=_command_line(), **kwargs)
        out = asyncio.run(execute(name, options))
        click.echo(str(out))

    return command


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def load_description(name: str) -> tuple[str, None]:
    """A scenario's one-paragraph help without importing its heavy dependencies."""
    import importlib.util

    spec = importlib.util.find_spec(f"{PACKAGE}.scenarios.{MODULES[name]}")
    doc = ""
    if spec is not None and spec.origin:
        text = Path(spec.origin).read_text()
        if text.startswith('"""'):
            doc = text[3 : text.index('"""', 3)]
    return " ".join(doc.split()), None


for _name in MODULES:
    bench.add_command(_scenario_command(_name))


@bench.command(name="summary")
@click.argument("folders", nargs=-1, type=click.Path(exists=True, path_type=Path))
def summary(folders: tuple[Path, ...]) -> None:
    """Print one Markdown table of the targets judged by several result folders, each
    row's figure followed by its folder's name (two runs of one scenario, e.g. with
    and without ``--api append``, stay apart), then how many were met and missed."""
    rows: list[dict[str, Any]] = []
    for folder in folders:
        data = json.loads((folder / "results.json").read_text())
        for t in data.get("targets", []):
            rows.append({**t, "figure": f"{t['figure']} [`{folder.resolve().name}`]"})
    click.echo(report.targets_table(rows))
    click.echo(f"\n{report.target_counts(rows)}")


def _command_line() -> str:
    argv = list(sys.argv)
    head = Path(argv[0]).name if argv else "bufstore"
    if head in ("__main__.py", "-m"):
        head = f"python -m {PACKAGE}"
    return " ".join([head, *map(shlex.quote, argv[1:])])


async def execute(name: str, options: Options) -> Path:
    """Run one scenario and write its results; returns the results folder."""
    description, run = load(name)
    bench_ = Bench(name, options)
    started = time.time()
    load_before = os.getloadavg()
    bench_.say(f"[bold]{name}[/]: results in {bench_.output}")
    speed_before = await speed()
    # The commit and tree of the code that runs: taken before, as the tree may change
    # while a long run goes on (a commit made meanwhile is not what was measured).
    versions_at_start = versions()
    async with bench_.running():
        outcome = await run(bench_)
        pg_settings = await bench_.pg_settings()
        server_version = await _nats_version(bench_.nats_url)
    result: dict[str, Any] = {
        "scenario": name,
        "description": description,
        "command": options.command,
        "quick": options.quick,
        "profiled": options.profile,
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
        "elapsed_s": round(time.time() - started, 1),
        "machine": machine(),
        "loadavg_1_5_15": {"at_start": load_before, "at_end": os.getloadavg()},
        "machine_speed": {"at_start": speed_before, "at_end": await speed()},
        "versions": versions_at_start,
        "nats_server_version": server_version or nats_server_version(),
        "pg_settings": pg_settings,
        "parameters": outcome.parameters,
        "targets": outcome.targets,
        "sides": outcome.sides,
        "sections": outcome.sections,
        **({"figures": outcome.figures} if outcome.figures else {}),
        "methods": outcome.methods,
        "latency_of": outcome.latency_of,
        "notes": bench_.notes
        + (
            ["profiled run: cProfile slows the measured code; use a plain run's figures"]
            if options.profile
            else []
        ),
    }
    report.write_all(result, bench_.output, outcome.extra_plots, outcome.side_rows)
    _echo_targets(bench_, outcome.targets)
    return bench_.output


async def _nats_version(url: str) -> str | None:
    try:
        nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    except Exception:
        return None
    try:
        found = re.search(r"\d+\.\d+\.\d+", str(nc.connected_server_version))
        return found.group(0) if found else None
    finally:
        await nc.close()


def _echo_targets(bench_: Bench, targets: list[dict[str, Any]]) -> None:
    show: Callable[[str], None] = bench_.say
    for t in targets:
        verdict = {True: "[green]met[/]", False: "[red]missed[/]", None: "n/a"}[t.get("met")]
        show(f"{verdict}  {t['figure']}: {t['measured']}")
