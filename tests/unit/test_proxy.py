"""`CuttableProxy` in front of a local echo server: it forwards, `cut()` drops the open
connections and hangs up on new ones, `restore()` lets them through again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from buffered_store.dev.proxy import CuttableProxy, url_via


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def roundtrip(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), 5)
    finally:
        writer.close()


async def test_forwards_cuts_and_restores(echo_port: int) -> None:
    with CuttableProxy("127.0.0.1", echo_port) as proxy:
        assert await roundtrip(proxy.port, b"hello") == b"hello"
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"open")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"open"

        proxy.cut()
        assert proxy.is_cut
        # The open connection is dropped: the client reads end of stream.
        assert await asyncio.wait_for(reader.read(10), 5) == b""
        writer.close()
        # A new connection is hung up on before any byte comes back.
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await roundtrip(proxy.port, b"while cut")
        assert proxy.refused >= 1

        proxy.restore()
        assert await roundtrip(proxy.port, b"again") == b"again"
        assert proxy.connections == 3


def test_url_via_keeps_credentials_path_and_query() -> None:
    url = "postgresql+psycopg://user:pw@db.example:5432/test?sslmode=disable"
    assert url_via(url, "127.0.0.1", 6000) == (
        "postgresql+psycopg://user:pw@127.0.0.1:6000/test?sslmode=disable"
    )
    assert url_via("nats://127.0.0.1:4222", "127.0.0.1", 7) == "nats://127.0.0.1:7"
    proxy = CuttableProxy.in_front_of("nats://10.0.0.1:4223")
    assert proxy.target == ("10.0.0.1", 4223)
