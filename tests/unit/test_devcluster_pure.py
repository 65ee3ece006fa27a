"""The pure parts of the throwaway NATS cluster: node config text and leader lookup."""

from __future__ import annotations

from typing import Any

from buffered_store.dev.cluster import nats_cluster_config_text, stream_leaders


def node_config(**overrides: Any) -> str:
    settings: dict[str, Any] = {
        "server_name": "n1",
        "host": "127.0.0.1",
        "port": 4001,
        "monitor_port": 8001,
        "cluster_port": 6001,
        "route_ports": [6000, 6002],
        "store_dir": "/tmp/n1 store",
    }
    settings.update(overrides)
    return nats_cluster_config_text(**settings)


def test_node_config_names_the_node_and_its_listeners() -> None:
    text = node_config()
    assert 'server_name: "n1"' in text
    assert 'listen: "127.0.0.1:4001"' in text
    assert 'http: "127.0.0.1:8001"' in text
    assert 'listen: "127.0.0.1:6001"' in text  # the cluster listener


def test_node_config_routes_to_the_other_nodes_only() -> None:
    text = node_config()
    assert '"nats-route://127.0.0.1:6000"' in text
    assert '"nats-route://127.0.0.1:6002"' in text
    assert "nats-route://127.0.0.1:6001" not in text  # not to itself
    assert 'name: "bufstore"' in text


def test_node_config_enables_jetstream_with_a_quoted_store_dir() -> None:
    text = node_config()
    assert 'jetstream {\n  store_dir: "/tmp/n1 store"\n}' in text
    assert "sync_interval" not in text
    assert "sync_interval: always" in node_config(sync_always=True)


def test_stream_leaders_reads_the_jsz_document() -> None:
    jsz = {
        "account_details": [
            {
                "stream_detail": [
                    {"name": "OTHER", "cluster": {"leader": "n0"}},
                    {"name": "WAL", "cluster": {"leader": "n2"}},
                ]
            }
        ]
    }
    assert stream_leaders(jsz, "WAL") == ["n2"]
    assert stream_leaders(jsz, "MISSING") == []


def test_stream_leaders_during_an_election_or_without_monitoring() -> None:
    electing = {"account_details": [{"stream_detail": [{"name": "WAL", "cluster": {}}]}]}
    assert stream_leaders(electing, "WAL") == []
    assert stream_leaders(None, "WAL") == []
    assert stream_leaders({"account_details": None}, "WAL") == []
