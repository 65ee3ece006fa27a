"""The first NATS connection: which failures are retried, and what the
log says once connected (one line per change of state, not per attempt)."""

from __future__ import annotations

import logging
import ssl

import nats.errors
import pytest

from buffered_store.config import ConnectionSettings, EngineConfig
from buffered_store.errors import ConfigError
from buffered_store.nats.connect_policy import Failure, classify, describe
from buffered_store.nats.connection import ConnectionLog, tls_context


def verify_failure() -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, "certificate verify failed")
    exc.verify_message = "self-signed certificate in certificate chain"
    return exc


@pytest.mark.parametrize(
    ("exc", "failure"),
    [
        (nats.errors.Error("nats: 'Authorization Violation'"), Failure.AUTH),
        (nats.errors.AuthorizationError(), Failure.AUTH),
        (nats.errors.Error("nats: 'User Authentication Expired'"), Failure.AUTH),
        (verify_failure(), Failure.TLS),
        (ssl.SSLError(1, "tlsv13 alert certificate required"), Failure.TLS),
        (ConnectionRefusedError(111, "Connect call failed"), Failure.TRANSIENT),
        (TimeoutError(), Failure.TRANSIENT),
        (nats.errors.NoServersError(), Failure.TRANSIENT),
        (
            nats.errors.Error("nats: empty response from server when expecting INFO"),
            Failure.TRANSIENT,
        ),
        (ValueError("invalid creds file"), Failure.CONFIG),
    ],
)
def test_classify(exc: BaseException, failure: Failure) -> None:
    assert classify(exc) is failure


def test_describe_names_the_tls_reason_and_the_server_refusal() -> None:
    assert describe(verify_failure()) == "TLS: self-signed certificate in certificate chain"
    assert describe(nats.errors.Error("nats: 'Authorization Violation'")) == (
        "Error: Authorization Violation"
    )


class FakeClient:
    """What `ConnectionLog` reads of a nats-py client."""

    def __init__(self) -> None:
        self.is_connected = True
        self.is_closed = False


async def test_reconnecting_logs_one_line_per_state_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events = ConnectionLog("nats://svc:pw@nats:4222")
    client = FakeClient()
    events.client = client  # type: ignore[assignment]
    events.connected = True
    caplog.set_level(logging.INFO, logger="buffered_store.nats.wal")
    client.is_connected = False
    await events.on_disconnected()
    for _ in range(50):  # one per reconnection attempt
        await events.on_error(ConnectionRefusedError(111, "Connect call failed"))
    client.is_connected = True
    await events.on_reconnected()
    lines = [(r.levelname, getattr(r, "action", "")) for r in caplog.records]
    assert lines == [("WARNING", "nats_disconnected"), ("INFO", "nats_reconnected")]
    assert "50 failed attempt(s)" in caplog.records[1].getMessage()
    assert "pw" not in caplog.text


async def test_errors_while_connected_are_warnings(caplog: pytest.LogCaptureFixture) -> None:
    events = ConnectionLog("nats://nats:4222")
    events.client = FakeClient()  # type: ignore[assignment]
    events.connected = True
    caplog.set_level(logging.INFO, logger="buffered_store.nats.wal")
    await events.on_error(nats.errors.Error("nats: permissions violation"))
    assert [getattr(r, "action", "") for r in caplog.records] == ["nats_error"]


async def test_first_connection_attempts_and_a_deliberate_close_log_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events = ConnectionLog("nats://nats:4222")
    client = FakeClient()
    events.client = client  # type: ignore[assignment]
    caplog.set_level(logging.INFO, logger="buffered_store.nats.wal")
    client.is_connected = False
    await events.on_error(ConnectionRefusedError(111, "refused"))
    await events.on_disconnected()  # nats-py closing a failed attempt
    events.connected = True
    client.is_closed = True
    await events.on_disconnected()  # closed by us
    assert caplog.records == []


def test_tls_files_that_do_not_exist_are_a_configuration_error(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match="TLS"):
        tls_context(ConnectionSettings(tls_ca_file="/nonexistent/ca.pem"))
    assert tls_context(ConnectionSettings()) is None


def test_a_key_without_its_certificate_is_refused() -> None:
    with pytest.raises(ConfigError, match="tls_cert_file"):
        EngineConfig(tls_key_file="/x/key.pem")
