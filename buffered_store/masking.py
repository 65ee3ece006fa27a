"""Credentials out of anything shown: URLs, connection strings and error texts. Pure.

Every URL that reaches output (the CLI), logs, metrics or an exception text goes through
`mask_url` or `mask_credentials` first, so a NATS or Postgres password, a NATS token, a
libpq ``password=`` setting or an nkey seed never leaves the process. The user name
stays (it helps to tell which account failed); the secret becomes `MASK`.
"""

from __future__ import annotations

import re

MASK = "***"
"""What a secret is replaced with."""

TOKEN_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})
"""Schemes whose user part alone (``nats://TOKEN@host``) is a secret: a NATS token."""

# A scheme, then the user info up to the last "@" before the host: it cannot contain
# "/" or white space, so it never runs into the next URL of a comma-separated list.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*)://(?P<info>[^\s/'\"<>]*)@")
# libpq conninfo (`password=x`, `password='x y'`) and URL query parameters (`&password=x`).
_SETTING = re.compile(
    r"(?P<key>\b(?:ssl)?password|\bpasswd|\btoken|\bsslkey_password)(?P<eq>\s*=\s*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'|[^\s&;,'\"]+)",
    re.IGNORECASE,
)
# A NATS creds file's seed block, should its contents ever be quoted.
_SEED_BLOCK = re.compile(
    r"(-----BEGIN [A-Z ]*NKEY SEED-----)(.*?)(------?END [A-Z ]*NKEY SEED------?)", re.S
)
# A bare nkey seed (S + key type + 56 base32 characters).
_SEED = re.compile(r"\bS[OAUNCPX][A-Z2-7]{56}\b")


def mask_url(url: str) -> str:
    """`url` (or a comma-separated list of URLs) with its password, or its NATS token,
    replaced by `MASK`; anything else unchanged."""
    return mask_credentials(url)


def mask_credentials(text: str) -> str:
    """`text` with every secret it may quote masked: the password (or NATS token) in
    each URL, libpq and query-string ``password=`` settings, nkey seeds."""
    text = _URL_USERINFO.sub(_mask_userinfo, text)
    text = _SETTING.sub(lambda m: m.group("key") + m.group("eq") + MASK, text)
    text = _SEED_BLOCK.sub(lambda m: f"{m.group(1)}\n{MASK}\n{m.group(3)}", text)
    return _SEED.sub(MASK, text)


def _mask_userinfo(match: re.Match[str]) -> str:
    scheme, info = match.group("scheme"), match.group("info")
    user, colon, _secret = info.partition(":")
    if colon:
        return f"{scheme}://{user}:{MASK}@"
    if scheme.lower() in TOKEN_SCHEMES:
        return f"{scheme}://{MASK}@"
    return match.group(0)  # a user name alone (Postgres): nothing secret
