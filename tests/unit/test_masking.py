"""Credentials never leave in a URL, a connection string or an error text."""

from __future__ import annotations

import pytest

from buffered_store.logs import scrub
from buffered_store.masking import MASK, mask_credentials, mask_url

SECRET = "s3cr#t-PW"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://alice:pw@nats:4222", f"nats://alice:{MASK}@nats:4222"),
        ("tls://alice:p@ss@nats:4222", f"tls://alice:{MASK}@nats:4222"),
        ("nats://TOKEN123@nats:4222", f"nats://{MASK}@nats:4222"),
        ("nats://nats:4222", "nats://nats:4222"),
        (
            "nats://a:pw1@n1:4222,nats://b:pw2@n2:4222, tls://n3:4222",
            f"nats://a:{MASK}@n1:4222,nats://b:{MASK}@n2:4222, tls://n3:4222",
        ),
        ("postgresql://bob:pw@db/app", f"postgresql://bob:{MASK}@db/app"),
        ("postgresql+psycopg://bob:pw@db:5432/app", f"postgresql+psycopg://bob:{MASK}@db:5432/app"),
        ("postgresql://bob@db/app", "postgresql://bob@db/app"),
        (
            "postgresql://db/app?user=bob&password=pw&sslmode=require",
            f"postgresql://db/app?user=bob&password={MASK}&sslmode=require",
        ),
        (
            "jdbc:postgresql://db:5432/app?user=bob&password=pw",
            f"jdbc:postgresql://db:5432/app?user=bob&password={MASK}",
        ),
    ],
)
def test_mask_url_hides_the_secret_and_keeps_the_rest(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_libpq_conninfo_passwords_are_masked_quoted_or_not() -> None:
    text = "host=db user=bob password=pw1 sslpassword='a b' dbname=app"
    assert mask_credentials(text) == (
        f"host=db user=bob password={MASK} sslpassword={MASK} dbname=app"
    )


def test_nkey_seeds_are_masked() -> None:
    seed = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU"
    creds = (
        "-----BEGIN NATS USER JWT-----\neyJ0eXAi.x.y\n------END NATS USER JWT------\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
    masked = mask_credentials(creds)
    assert seed not in masked
    assert "eyJ0eXAi.x.y" in masked  # a JWT is public: it proves nothing without the seed
    assert seed not in mask_credentials(f"bad seed {seed} given")


def test_error_texts_quoting_a_url_are_masked() -> None:
    text = f"connect to nats://svc:{SECRET}@127.0.0.1:4222: NATS unavailable"
    assert SECRET not in mask_credentials(text)
    assert "nats://svc:" in mask_credentials(text)


def test_log_scrubbing_masks_credentials() -> None:
    assert SECRET not in scrub(f"could not connect to postgresql://u:{SECRET}@db/app")
    assert SECRET not in scrub(f"dsn host=db password={SECRET}")


def test_text_without_secrets_is_unchanged() -> None:
    text = "thread 'a@b' flushed up to seq 3; see https://example.org/x?y=1"
    assert mask_credentials(text) == text
