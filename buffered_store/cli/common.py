"""Options and helpers shared by the `bufstore` commands."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from buffered_store.config import BufferedStoreConfig, EngineConfig
from buffered_store.engine.entries import Format
from buffered_store.errors import StoreError
from buffered_store.masking import mask_credentials

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


NATS_ACCESS_FIELDS = {
    "nats_credentials": "credentials",
    "nats_tls_ca": "tls_ca_file",
    "nats_tls_cert": "tls_cert_file",
    "nats_tls_key": "tls_key_file",
}
"""Options of `nats_url_option` beyond the URL -> the configuration field they set."""


def _remember_access(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value and param.name:
        ctx.meta.setdefault("bufstore_nats", {})[NATS_ACCESS_FIELDS[param.name]] = value


def _access_option(name: str, field: str, help_text: str) -> Callable[[F], F]:
    return click.option(
        name,
        expose_value=False,
        callback=_remember_access,
        show_default=f"$BUFSTORE_{field.upper()}",
        help=help_text,
    )


def nats_url_option(func: F) -> F:
    """`--nats-url` and how to reach it: `--nats-credentials`, `--nats-tls-ca`,
    `--nats-tls-cert`, `--nats-tls-key` (read back by `nats_access`)."""
    options = [
        click.option(
            "--nats-url",
            default=lambda: os.environ.get("BUFSTORE_NATS_URL") or os.environ.get("NATS_URL"),
            show_default="$BUFSTORE_NATS_URL or $NATS_URL",
            help="NATS server URL(s).",
        ),
        _access_option("--nats-credentials", "credentials", "NATS .creds file."),
        _access_option("--nats-tls-ca", "tls_ca_file", "CA file to verify NATS servers with."),
        _access_option("--nats-tls-cert", "tls_cert_file", "Client certificate for NATS."),
        _access_option("--nats-tls-key", "tls_key_file", "Key of --nats-tls-cert."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def nats_access() -> dict[str, str]:
    """The NATS credentials and TLS files given as options to the current command, as
    configuration fields (empty outside a command)."""
    ctx = click.get_current_context(silent=True)
    return dict(ctx.meta.get("bufstore_nats", {})) if ctx is not None else {}


database_url_option = click.option(
    "--database-url",
    default=lambda: os.environ.get("DATABASE_URL"),
    show_default="$DATABASE_URL",
    help="Postgres URL of the inner store.",
)
schema_option = click.option(
    "--schema",
    default=lambda: os.environ.get("BUFSTORE_SCHEMA", "public"),
    show_default="$BUFSTORE_SCHEMA or public",
    help="Postgres schema of the tables.",
)


def store_options(func: F) -> F:
    """`--nats-url`, `--database-url` and `--schema`, with environment fallbacks."""
    return nats_url_option(database_url_option(schema_option(func)))


def store_config(nats_url: str | None) -> BufferedStoreConfig:
    """The store configuration from `BUFSTORE_*` variables, with the URL option applied."""
    overrides: dict[str, Any] = {"drain_on_close": False, **nats_access()}
    if nats_url:
        overrides["nats_url"] = nats_url
    return BufferedStoreConfig.from_env(**overrides)


def require(value: str | None, what: str) -> str:
    """A required option, or a usage error naming it."""
    if not value:
        raise click.UsageError(f"{what} is required (option or environment variable)")
    return value


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine; our errors become a one-line message (credentials masked) and
    exit status 1."""
    try:
        return asyncio.run(main())
    except StoreError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {mask_credentials(str(exc))}") from exc


FRONT_ENDS = ("threadrun", "langgraph")

front_end_option = click.option(
    "--front-end",
    type=click.Choice(FRONT_ENDS),
    default="threadrun",
    show_default=True,
    help="Whose WAL: langgraph reads the LangGraph checkpointer's stream, buckets and "
    "consumer (BUFSTORE_LG_* variables) and its watermarks in bufstore_lg_threads.",
)


def langgraph_config(nats_url: str | None, database_url: str | None) -> Any:
    """The LangGraph front-end's `LangGraphConfig` (``BUFSTORE_LG_*``) with the options
    given to the current command applied. A ``--database-url`` given on the command line
    wins over ``BUFSTORE_LG_DATABASE_URL``, which wins over ``$DATABASE_URL`` (which may
    be the thread-run store's)."""
    from buffered_store.langgraph.config import LangGraphConfig

    ctx = click.get_current_context(silent=True)
    if ctx is not None and database_url is not None:
        source = ctx.get_parameter_source("database_url")
        explicit = source is click.core.ParameterSource.COMMANDLINE
        if not explicit and "BUFSTORE_LG_DATABASE_URL" in os.environ:
            database_url = None
    given: dict[str, Any] = {"nats_url": nats_url, "database_url": database_url}
    given.update(nats_access())
    return LangGraphConfig.from_env(None, **{k: v for k, v in given.items() if v})


@dataclass(frozen=True, slots=True)
class FrontEndView:
    """What the read-only commands (`status`, `health`) need of one front-end."""

    name: str
    config: EngineConfig
    fmt: Format[Any, Any]
    database_url: str | None
    """Where its watermarks live (None: not given, only the WAL is read); for LangGraph
    a libpq URL or conninfo."""
    schema: str = "public"

    async def watermarks(self, threads: list[str]) -> dict[str, int]:
        """The flushed seqs Postgres holds for `threads` (empty without a URL or threads)."""
        if not self.database_url or not threads:
            return {}
        if self.name == "langgraph":
            from buffered_store.langgraph.sink import LangGraphSink

            sink = await LangGraphSink.open(self.database_url, min_size=0)
            try:
                return dict(await sink.flushed_seqs(threads))
            finally:
                await sink.close()
        from buffered_store.stores.postgres import PostgresThreadRunStore

        inner = await PostgresThreadRunStore.connect(self.database_url, schema=self.schema)
        try:
            return dict(await inner.flushed_seqs(threads))
        finally:
            await inner.close()


def front_end_view(
    front_end: str, nats_url: str | None, database_url: str | None, schema: str | None = None
) -> FrontEndView:
    """The configuration, entry format and watermark location of `front_end` for the
    current command (`schema` None: ``$BUFSTORE_SCHEMA`` or public)."""
    schema = schema or os.environ.get("BUFSTORE_SCHEMA", "public")
    if front_end == "langgraph":
        from buffered_store.langgraph.format import (
            LG_FORMAT,
        )

        lg = langgraph_config(nats_url, database_url)
        given = database_url or os.environ.get("BUFSTORE_LG_DATABASE_URL")
        return FrontEndView("langgraph", lg, LG_FORMAT, lg.conninfo if given else None)
    from buffered_store.threadrun.entry import FORMAT

    return FrontEndView("threadrun", store_config(nats_url), FORMAT, database_url, schema)
