"""PostgreSQL URLs in the three spellings the store's clients want: SQLAlchemy
(``postgresql+psycopg://``), libpq/psycopg (``postgresql://``) and JDBC. Pure."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

DEFAULT_DATABASE = "bufstore"
"""Database a JDBC URL names when the URL it is made from names none."""

_PG_SCHEME = re.compile(r"^(postgres|postgresql)(\+[A-Za-z0-9_]+)?://", re.IGNORECASE)


def to_sqlalchemy_url(url: str) -> str:
    """``postgres://``/``postgresql://`` -> ``postgresql+psycopg://``; explicit drivers are kept."""
    match = _PG_SCHEME.match(url)
    if match is None:
        raise ValueError(f"not a PostgreSQL URL: {url!r}")
    if match.group(2):
        return "postgresql" + match.group(2) + "://" + url[match.end() :]
    return "postgresql+psycopg://" + url[match.end() :]


def to_libpq_url(url: str) -> str:
    """Strip the SQLAlchemy ``+driver`` part so psycopg/libpq accept the URL."""
    match = _PG_SCHEME.match(url)
    if match is None:
        raise ValueError(f"not a PostgreSQL URL: {url!r}")
    return "postgresql://" + url[match.end() :]


def jdbc_url_from_url(url: str) -> str:
    """Turn a SQLAlchemy/libpq PostgreSQL URL into a JDBC URL (credentials as parameters)."""
    parts = urlsplit(to_libpq_url(url))
    host = parts.hostname or "localhost"
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    port = parts.port or 5432
    database = unquote(parts.path.lstrip("/")) or DEFAULT_DATABASE
    params: list[tuple[str, str]] = []
    if parts.username:
        params.append(("user", unquote(parts.username)))
    if parts.password:
        params.append(("password", unquote(parts.password)))
    params.extend(parse_qsl(parts.query))
    query = f"?{urlencode(params)}" if params else ""
    return f"jdbc:postgresql://{host}:{port}/{database}{query}"
