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
