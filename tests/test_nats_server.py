"""The nats-server children we start: ports that other processes cannot have taken by
accident, and a server that will not start says why."""

from __future__ import annotations

import socket

import pytest

from llmbus.deploy.nats_server import NatsServer, _ephemeral_low, free_port


def test_free_ports_are_distinct_and_outside_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= port < _ephemeral_low() for port in ports)  # where no client's local port is


def _listener(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


@pytest.mark.parametrize("which", ["port", "monitor_port"])
def test_a_port_taken_before_the_server_binds_it_is_picked_again(which):
    server = NatsServer()
    taken = getattr(server, which)
    squatter = _listener(taken)  # another process's listener, between the pick and the start
    try:
        server.start()
        assert getattr(server, which) != taken and server.url.endswith(f":{server.port}")
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as conn:
            assert conn.recv(5) == b"INFO "  # nats-server itself, not the squatter
    finally:
        server.stop()
        squatter.close()


def test_a_taken_port_the_caller_chose_or_a_cluster_port_is_an_error_that_says_why():
    chosen = free_port()
    squatter = _listener(chosen)
    try:
        with pytest.raises(RuntimeError, match=f"address already in use.*{chosen}|{chosen}.*address already in use"):
            NatsServer(port=chosen).start()
        node = NatsServer(cluster_port=chosen, routes=[])
        with pytest.raises(RuntimeError, match="address already in use"):
            node.start()
        node.stop()
    finally:
        squatter.close()
