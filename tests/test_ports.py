"""The suite shares its machine: other services' ports are out of its reach, and the
API's default port can be held by someone else while it runs (``tests/ports.py``)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from tests import ports, stack


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


def test_seaweedfs_ports_are_drawn_outside_the_ephemeral_range() -> None:
    # Outgoing connections take source ports from 32768 up (Linux's default range): a
    # port drawn there could be gone before SeaweedFS binds it.
    for _ in range(50):
        p = stack.free_port_pair()
        assert p >= 1024 and p + 10000 < 32768


@pytest.mark.integration
def test_seaweedfs_taking_a_port_already_in_use_is_started_again_on_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its filer's port is taken between the draw and weed's bind (as a client connection's
    # source port once did): weed exits, and the server comes up on other ports.
    with socket.socket() as held:
        held.bind(("127.0.0.1", stack.free_port_pair()))  # its gRPC port (+10000) stays free
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([stack.free_port_pair(), stack.free_port_pair(), taken])
        real = stack.free_port_pair
        monkeypatch.setattr(stack, "free_port_pair", lambda: next(draws, None) or real())
        server = stack.S3Server(tmp_path / "weed").start()
        try:
            assert b"address already in use" in (tmp_path / "weed" / "weed.log").read_bytes()
            server.client().put_object(Bucket=stack.S3_BUCKET, Key="k", Body=b"v")
            body = server.client().get_object(Bucket=stack.S3_BUCKET, Key="k")["Body"].read()
            assert body == b"v"
        finally:
            server.stop()
