"""The suite shares its machine: other services' ports are out of its reach, and the
API's default port can be held by someone else while it runs (``tests/ports.py``)."""

from __future__ import annotations

import socket

import pytest
import redis

from tests import ports


def test_the_machines_redis_and_default_ports_are_refused_in_tests() -> None:
    before = len(ports.attempts)
    # A client left on its defaults (redis-py's, the settings' redis://127.0.0.1:6379)
    # finds nothing, even where the machine runs its own Redis there.
    with pytest.raises(redis.ConnectionError):
        redis.Redis(socket_timeout=2).ping()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", 8000), timeout=2)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", 9333)) != 0
    made = ports.attempts[before:]
    del ports.attempts[before:]  # made on purpose: not this test's failure
    assert sorted({a.split(" ")[0] for a in made}) == [
        "127.0.0.1:6379", "127.0.0.1:8000", "127.0.0.1:9333"]


def test_free_ports_stay_reachable() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname(), timeout=2):
            pass


def test_the_default_api_port_is_held_for_the_tests_that_ask(
        default_api_port_taken: None) -> None:
    assert ports.taken(8000)
