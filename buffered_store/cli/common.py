"""Options and helpers shared by the `bufstore` commands."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click

from buffered_store.config import BufferedStoreConfig
from buffered_store.errors import StoreError
from buffered_store.masking import mask_credentials

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


nats_url_option = click.option(
    "--nats-url",
    default=lambda: os.environ.get("BUFSTORE_NATS_URL") or os.environ.get("NATS_URL"),
    show_default="$BUFSTORE_NATS_URL or $NATS_URL",
    help="NATS server URL(s).",
)
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
    overrides: dict[str, Any] = {"drain_on_close": False}
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
