"""The machine is shared: its well-known ports belong to whoever else runs there.

Another ``make run`` may listen on 127.0.0.1:8000, the machine's own Redis on 6379, a
SeaweedFS on its defaults. Tests start their servers on free ports (``tests.stack``), and
this module makes the rule hold rather than hope:

- :func:`guard_connections` refuses, inside the test process, every TCP connection to a
  well-known port on loopback, as if nothing listened there, and records it; the suite's
  autouse fixture fails the test that tried (it relied on somebody else's server).
- :func:`hold` listens on a well-known port while a test runs (when nobody else does),
  so a test that would bind it, or that only works when it is free, fails every time
  instead of only on a busy machine.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator
from typing import Any

from app.run_local import port_free

# Port -> whose default it is.
WELL_KNOWN = {
    8000: "the API's (`make run`)",
    6379: "Redis's",
    8333: "SeaweedFS S3's",
    9333: "SeaweedFS master's",
}
LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"}

attempts: list[str] = []


def _refused(sock: socket.socket, address: Any) -> bool:
    """Whether ``address`` is a well-known loopback port (recorded when it is)."""
    if (sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple)
            and address[0] in LOOPBACK and address[1] in WELL_KNOWN):
        attempts.append(f"{address[0]}:{address[1]} ({WELL_KNOWN[address[1]]} default)")
        return True
    return False


@contextlib.contextmanager
def guard_connections() -> Iterator[None]:
    """Refuse (and record) connections to :data:`WELL_KNOWN` ports on loopback."""
    saved = socket.socket.connect, socket.socket.connect_ex

    def connect(self: socket.socket, address: Any) -> None:
        if _refused(self, address):
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, f"tests may not use {address[0]}:{address[1]}")
        saved[0](self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        return errno.ECONNREFUSED if _refused(self, address) else saved[1](self, address)

    socket.socket.connect = connect  # type: ignore[method-assign, assignment]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        socket.socket.connect, socket.socket.connect_ex = saved  # type: ignore[method-assign]


def taken(port: int) -> bool:
    """Whether a server binding 127.0.0.1:``port`` now would fail (as uvicorn's would):
    the local run's own check."""
    return not port_free(port)


@contextlib.contextmanager
def hold(port: int) -> Iterator[bool]:
    """Listen on 127.0.0.1:``port`` for the block; yields whether this process holds it
    (False: something else already does, which is the same condition)."""
    sock = socket.socket()
    try:
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
            ours = True
        except OSError:
            ours = False
        yield ours
    finally:
        sock.close()
