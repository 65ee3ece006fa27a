"""A throwaway three-node NATS JetStream cluster on loopback, for cluster and chaos tests.

Each node is a ``nats-server`` process with its own config file and store dir; the nodes
find each other through cluster routes on free loopback ports. `NatsCluster.url` lists
every node, so a client fails over when the one it talks to dies. Nodes are killed and
restarted by index (their own PID only); `stream_leader` tells which node leads a stream,
so a test can kill exactly the leader or exactly a follower.

Readiness is awaited, never slept: a node is ready when it speaks NATS, its ``/healthz``
answers 200 (in a cluster that needs contact with the JetStream meta leader and, after a
restart, its streams caught up) and ``/jsz`` names a meta leader.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buffered_store.backoff import Backoff
from buffered_store.dev.common import (
    LOCALHOST,
    DevServiceError,
    ServerContext,
    ServiceStartError,
    http_ok,
    ms_since,
    pick_free_ports,
    say,
    tail_text,
)
from buffered_store.dev.nats_server import find_nats_server, nats_info_probe, nats_url
from buffered_store.dev.processes import register, unregister

__all__ = ["ClusterNode", "NatsCluster", "nats_cluster_config_text"]

CLUSTER_NAME = "bufstore"


def _quoted(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid NATS config string


def nats_cluster_config_text(
    *,
    server_name: str,
    host: str,
    port: int,
    monitor_port: int,
    cluster_port: int,
    route_ports: Sequence[int],
    store_dir: str | os.PathLike[str],
    cluster_name: str = CLUSTER_NAME,
    sync_always: bool = False,
) -> str:
    """Config file of one cluster node: client, monitor and cluster listeners, JetStream.

    ``route_ports`` are the cluster ports of the other nodes. Everything lives in the
    file (no ``-sd``/``-js`` flags), because nats-server rejects a store dir given twice.
    """
    routes = ",\n    ".join(_quoted(f"nats-route://{host}:{p}") for p in route_ports)
    sync = "  sync_interval: always\n" if sync_always else ""
    return (
        f"server_name: {_quoted(server_name)}\n"
        f"listen: {_quoted(f'{host}:{port}')}\n"
        f"http: {_quoted(f'{host}:{monitor_port}')}\n"
        "jetstream {\n"
        f"  store_dir: {_quoted(os.fspath(store_dir))}\n"
        f"{sync}"
        "}\n"
        "cluster {\n"
        f"  name: {_quoted(cluster_name)}\n"
        f"  listen: {_quoted(f'{host}:{cluster_port}')}\n"
        "  routes: [\n"
        f"    {routes}\n"
        "  ]\n"
        "}\n"
    )


def _http_json(url: str, timeout: float = 1.0) -> Any:
    """The JSON body of a monitoring endpoint, or None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


@dataclass
class ClusterNode:
    """One node of a `NatsCluster`: its ports, files and (while running) its process."""

    index: int
    server_name: str
    host: str
    port: int
    monitor_port: int
    cluster_port: int
    store_dir: Path
    config_path: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Client URL of this node alone."""
        return nats_url(self.host, self.port)

    @property
    def monitor_url(self) -> str:
        """Base URL of the node's HTTP monitoring endpoints."""
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        """The node's PID while it runs."""
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        """True while the node's process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def meta_leader(self) -> str | None:
        """Server name of the JetStream meta leader as this node sees it (None if none)."""
        jsz = _http_json(f"{self.monitor_url}/jsz")
        if not isinstance(jsz, dict):
            return None
        meta = jsz.get("meta_cluster") or {}
        leader = meta.get("leader")
        return str(leader) if leader else None

    def ready(self) -> bool:
        """Speaks NATS, is healthy (JetStream current) and knows a meta leader."""
        return (
            nats_info_probe(self.host, self.port)
            and http_ok(f"{self.monitor_url}/healthz")
            and self.meta_leader() is not None
        )


class NatsCluster(ServerContext):
    """Three (or ``size``) ``nats-server`` processes forming one JetStream cluster.

    Ports are chosen once, so a restarted node comes back at the same address with the
    same store dir. ``kill()``/``restart()`` without an index act on every node, like the
    single-server `NatsServer`; the ``*_node`` methods act on one node.
    """

    name = "nats"
    managed = True

    def __init__(
        self,
        *,
        size: int = 3,
        binary: str | os.PathLike[str] | None = None,
        host: str = LOCALHOST,
        sync_always: bool = False,
        startup_timeout: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.binary = Path(binary) if binary is not None else find_nats_server()
        self.host = host
        self.startup_timeout = startup_timeout
        self._tmp_root = Path(tempfile.mkdtemp(prefix="bufstore-nats-cluster-"))
        ports = pick_free_ports(3 * size, host)
        cluster_ports = ports[2 * size :]
        self.nodes: list[ClusterNode] = []
        for i in range(size):
            base = self._tmp_root / f"n{i}"
            base.mkdir()
            node = ClusterNode(
                index=i,
                server_name=f"n{i}",
                host=host,
                port=ports[i],
                monitor_port=ports[size + i],
                cluster_port=cluster_ports[i],
                store_dir=base / "store",
                config_path=base / "nats-server.conf",
                log_path=base / "nats-server.log",
            )
            node.config_path.write_text(
                nats_cluster_config_text(
                    server_name=node.server_name,
                    host=host,
                    port=node.port,
                    monitor_port=node.monitor_port,
                    cluster_port=node.cluster_port,
                    route_ports=[p for j, p in enumerate(cluster_ports) if j != i],
                    store_dir=node.store_dir,
                    sync_always=sync_always,
                )
            )
            self.nodes.append(node)
        self._closed = False
        self._lock = threading.RLock()
        register(self)

    def __repr__(self) -> str:
        return f"NatsCluster(url={self.url!r}, pids={[n.pid for n in self.nodes]})"

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (the form `EngineConfig.nats_url` takes)."""
        return ",".join(node.url for node in self.nodes)

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start every node that is not running and wait until the cluster is ready."""
        with self._lock:
            if self._closed:
                raise DevServiceError("NatsCluster is closed")
            t0 = time.perf_counter()
            offsets = {n.index: self._launch(n) for n in self.nodes if not n.running}
            for node in self.nodes:
                self._wait_ready(node, offsets.get(node.index, 0))
            say(f"nats cluster ready on {self.url} in {ms_since(t0)}")

    def _launch(self, node: ClusterNode) -> int:
        """Start the node's process; returns the log offset of this start."""
        node.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = [os.fspath(self.binary), "-c", os.fspath(node.config_path)]
        offset = node.log_path.stat().st_size if node.log_path.exists() else 0
        with open(node.log_path, "ab") as log:
            node.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=node.config_path.parent,
                start_new_session=True,
            )
        return offset

    def _wait_ready(self, node: ClusterNode, log_offset: int) -> None:
        deadline = time.monotonic() + self.startup_timeout
        retry = Backoff(0.005, 0.1)
        while not node.ready():
            if node.proc is None or node.proc.poll() is not None:
                code = node.proc.returncode if node.proc is not None else None
                node.proc = None
                raise ServiceStartError(
                    f"nats-server {node.server_name} exited with code {code} during startup; "
                    f"cmd: {shlex.join([os.fspath(self.binary), '-c', str(node.config_path)])}"
                    "\n--- log tail ---\n" + tail_text(node.log_path, offset=log_offset)
                )
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"nats-server {node.server_name} not ready (healthy with a JetStream meta "
                    f"leader) after {self.startup_timeout:.0f}s\n--- log tail ---\n"
                    + tail_text(node.log_path, offset=log_offset)
                )
            time.sleep(retry.next_delay())

    def kill_node(self, index: int) -> None:
        """SIGKILL one node (no flush, no leadership hand-over) and reap it."""
        with self._lock:
            node = self.nodes[index]
            if node.proc is not None:
                say(f"killing nats-server {node.server_name} pid {node.proc.pid}")
                if node.proc.poll() is None:
                    node.proc.kill()
                node.proc.wait()
                node.proc = None

    def start_node(self, index: int) -> None:
        """Start one node again (same ports, same store) and wait until it is ready."""
        with self._lock:
            node = self.nodes[index]
            if node.running:
                return
            t0 = time.perf_counter()
            self._wait_ready(node, self._launch(node))
            say(f"nats-server {node.server_name} back (pid {node.pid}) in {ms_since(t0)}")

    def restart_node(self, index: int) -> None:
        """SIGKILL one node, then start it again and wait until it is ready."""
        with self._lock:
            self.kill_node(index)
            self.start_node(index)

    def stop_node(self, index: int, timeout: float = 10.0) -> None:
        """SIGTERM one node (graceful), SIGKILL after ``timeout``; reaps it."""
        with self._lock:
            node = self.nodes[index]
            proc = node.proc
            if proc is None:
                return
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            node.proc = None

    def stop(self) -> None:
        """Stop every node gracefully."""
        with self._lock:
            for node in self.nodes:
                self.stop_node(node.index)

    def kill(self) -> None:
        """SIGKILL every node."""
        with self._lock:
            for node in self.nodes:
                self.kill_node(node.index)

    def restart(self) -> None:
        """Stop every node and start the cluster again."""
        with self._lock:
            self.stop()
            self.start()

    def close(self) -> None:
        """Stop every node and delete the temporary directory (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self.stop()
            self._closed = True
            shutil.rmtree(self._tmp_root, ignore_errors=True)
            unregister(self)

    # -- who leads ----------------------------------------------------------------------

    def node_named(self, server_name: str) -> int:
        """Index of the node with this ``server_name``."""
        for node in self.nodes:
            if node.server_name == server_name:
                return node.index
        raise DevServiceError(f"no node named {server_name!r} in {self!r}")

    def stream_leader(self, stream: str) -> int | None:
        """Index of the node leading ``stream``, as the running nodes report it.

        None while no running node names a leader (an election is going on). The answer
        comes from the monitoring endpoint (``/jsz?streams=true``), the same fact as
        ``js.stream_info(stream).cluster.leader``, but without a client connection.
        """
        for node in self.nodes:
            if not node.running:
                continue
            jsz = _http_json(f"{node.monitor_url}/jsz?accounts=true&streams=true")
            for leader in stream_leaders(jsz, stream):
                index = self.node_named(leader)
                if self.nodes[index].running:
                    return index
        return None

    def wait_stream_leader(self, stream: str, *, timeout: float = 30.0) -> int:
        """Index of the node leading ``stream``, waiting for an election to finish."""
        deadline = time.monotonic() + timeout
        retry = Backoff(0.01, 0.2)
        while (leader := self.stream_leader(stream)) is None:
            if time.monotonic() > deadline:
                raise DevServiceError(f"stream {stream!r} has no leader after {timeout:.0f}s")
            time.sleep(retry.next_delay())
        return leader

    def follower_of(self, stream: str, *, timeout: float = 30.0) -> int:
        """Index of a running node that replicates ``stream`` without leading it."""
        leader = self.wait_stream_leader(stream, timeout=timeout)
        for node in self.nodes:
            if node.index != leader and node.running:
                return node.index
        raise DevServiceError(f"stream {stream!r} has no running follower")


def stream_leaders(jsz: Any, stream: str) -> list[str]:
    """Leader names of ``stream`` in a ``/jsz?accounts=true&streams=true`` document."""
    if not isinstance(jsz, dict):
        return []
    found: list[str] = []
    for account in jsz.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail.get("name") == stream:
                leader = (detail.get("cluster") or {}).get("leader")
                if leader:
                    found.append(str(leader))
    return found
