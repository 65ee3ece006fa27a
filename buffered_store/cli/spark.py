"""`bufstore spark-job NAME`: the Spark batch jobs (needs the ``spark`` extra and Java)."""

from __future__ import annotations

import click

from buffered_store.cli.common import require, store_options
from buffered_store.config import ReadConsistency

JOBS = ("run-stats", "export")


def register(group: click.Group) -> None:
    """Add the command to the `bufstore` group."""
    group.add_command(spark_job)


@click.command("spark-job")
@click.argument("name", type=click.Choice(JOBS))
@click.option(
    "--mode",
    type=click.Choice([m.value for m in ReadConsistency]),
    default=ReadConsistency.READ_YOUR_WRITES.value,
    show_default=True,
    help="read_your_writes merges the unflushed WAL tail; strong flushes first; "
    "eventual reads Postgres only.",
)
@click.option("--output", help="Output path (required by export; run-stats also writes there).")
@click.option("--jdbc-url", help="JDBC URL of Postgres, if it differs from --database-url.")
@click.option("--partitions", type=int, default=8, show_default=True, help="JDBC partitions.")
@click.option("--master", help="Spark master URL (default local[*]).")
@store_options
def spark_job(
    name: str,
    mode: str,
    output: str | None,
    jdbc_url: str | None,
    partitions: int,
    master: str | None,
    nats_url: str | None,
    database_url: str | None,
    schema: str,
) -> None:
    """Run the Spark job NAME (run-stats or export) over the store's tables."""
    if name == "export" and not output:
        raise click.UsageError("export needs --output")
    try:
        from buffered_store.spark.jobs import JobOptions, run_job
    except ImportError as exc:
        raise click.ClickException(
            f"the Spark jobs need the spark extra: pip install 'buffered-thread-store[spark]' "
            f"({exc})"
        ) from exc
    from buffered_store.errors import StoreError

    options = JobOptions(
        job=name,
        mode=ReadConsistency(mode),
        database_url=require(database_url, "--database-url"),
        nats_url=nats_url,
        schema=schema,
        jdbc_url=jdbc_url,
        partitions=partitions,
        output=output,
        master=master,
    )
    try:
        run_job(options, echo=click.echo)
    except StoreError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
