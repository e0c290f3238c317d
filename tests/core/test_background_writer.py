"""The background writer after a failure: the error reaches the producer, which never
waits forever for a buffer the writer holds (a merge whose shard upload failed had hung
on its next free buffer)."""

from __future__ import annotations

import queue

import pytest

from maec_core.io.writer import BackgroundWriter, WrittenFile


class FailingSink:
    """Refuses its second tensor (as a shard callback refusing an upload does)."""

    def __init__(self) -> None:
        self.begun = 0

    def begin(self, name: str, shape: tuple[int, ...], dtype: str | None) -> None:
        self.begun += 1
        if self.begun == 2:
            raise OSError("injected: the store refused the shard")

    def append(self, data: memoryview | bytes) -> None:
        pass

    def end(self) -> None:
        pass

    def close(self) -> list[WrittenFile]:
        return []

    def abort(self) -> None:
        pass


def test_a_failed_write_hands_back_every_buffer_and_raises_in_the_producer() -> None:
    """The engine's loop: take a free buffer, queue it, get it back once written. With
    two buffers and a deep queue, every buffer is in the queue when the sink fails; the
    parts drained unwritten must still give them back, so the producer reaches ``put``
    and sees the error."""
    free: queue.Queue[int] = queue.Queue()
    for buf in range(2):
        free.put(buf)
    writer = BackgroundWriter(FailingSink(), depth=8)
    with pytest.raises(OSError, match="refused the shard"):
        for i in range(50):
            buf = free.get(timeout=10)  # a hang here is the bug
            writer.put(f"t{i}", (1,), "F32", memoryview(b"\0" * 4),
                       done=lambda b=buf: free.put(b))
    writer.abort()
    # Every buffer the writer held is back; the producer holds the one it took for the
    # put that raised.
    assert free.qsize() == 1
