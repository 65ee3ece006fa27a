"""A TCP proxy on loopback that delays every chunk by a fixed time in each direction.

Used by `remote-db` to put Postgres behind a link with 2 ms more round trip (1 ms each
way). It runs as its own process (`python -m buffered_store.benchmarks.proxy`) so its work
never shares the measured process's CPU or GIL, and uses threads with `time.sleep` because asyncio's
timers round up to whole milliseconds (a 1 ms delay would become 1 to 2 ms).

Each direction of a connection has a reader thread that stamps chunks with their due
time and a writer thread that sends them when due, so a delayed chunk never holds up the
reading of the next one and order is kept. The process stops itself after
`--max-seconds`, or when its parent dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass

from . import PACKAGE

CHUNK = 65536


def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
    chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

    def writer() -> None:
        try:
            while True:
                due, data = chunks.get()
                if not data:
                    break
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        while True:
            data = src.recv(CHUNK)
            chunks.put((time.perf_counter() + delay_s, data))
            if not data:
                break
    except OSError:
        chunks.put((0.0, b""))
    thread.join()


def _handle(client: socket.socket, target: tuple[str, int], delay_s: float) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for sock in (client, upstream):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pipe, args=(upstream, client, delay_s), daemon=True)
    back.start()
    _pipe(client, upstream, delay_s)
    back.join()
    client.close()
    upstream.close()


def serve(
    listener: socket.socket, target: tuple[str, int], delay_s: float, max_seconds: float
) -> None:
    """Accept and proxy connections until `max_seconds` passed or the parent died."""
    parent = os.getppid()
    stop_at = time.monotonic() + max_seconds
    listener.settimeout(0.5)
    while time.monotonic() < stop_at and os.getppid() == parent:
        try:
            client, _ = listener.accept()
        except TimeoutError:
            continue
        client.settimeout(None)
        threading.Thread(target=_handle, args=(client, target, delay_s), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.proxy", description=__doc__)
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, default=1.0, help="delay in each direction")
    parser.add_argument("--listen-port", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=3600.0)
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    listener = socket.create_server(("127.0.0.1", args.listen_port))
    print(f"PORT {listener.getsockname()[1]}", flush=True)
    serve(listener, (host, int(port)), args.delay_ms / 1000, args.max_seconds)
    return 0


@dataclass
class ProxyProcess:
    """A running proxy process."""

    proc: asyncio.subprocess.Process
    port: int

    @property
    def pid(self) -> int | None:
        """The proxy's pid while it runs."""
        return self.proc.pid if self.proc.returncode is None else None

    async def stop(self) -> None:
        """Terminate the proxy and wait for it."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            await self.proc.wait()


async def start_proxy(
    target_host: str, target_port: int, *, delay_ms: float, max_seconds: float
) -> ProxyProcess:
    """Start `python -m buffered_store.benchmarks.proxy` and return once it listens."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        f"{PACKAGE}.proxy",
        "--target",
        f"{target_host}:{target_port}",
        "--delay-ms",
        str(delay_ms),
        "--max-seconds",
        str(max_seconds),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    if not line.startswith(b"PORT "):
        proc.kill()
        raise RuntimeError(f"proxy did not start: {line!r}")
    return ProxyProcess(proc, int(line.split()[1]))


if __name__ == "__main__":
    sys.exit(main())
