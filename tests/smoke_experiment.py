"""The transfer experiment's smoke run as a background process of the test session.

The smoke run is one single-threaded process of about ten minutes, most of it training;
the rest of the suite leaves the machine's second core idle for much of its time. So
``tests/conftest.py`` starts the run as soon as collection has selected its test, under
``nice`` so the other tests keep their share of the CPU, and moves that test to the end of
the session, where it waits for the run and checks what it wrote. Run alone, the test
starts the run itself and waits, as before. Whatever is still running when the session
ends is stopped by its process group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The test that reads the run's results (its node id's file part and name).
TEST_FILE = "tests/experiment/test_transfer_smoke.py"
TEST_NAME = "test_transfer_smoke"
# Lower priority than the tests running beside it: they may wait on services with
# timeouts, the smoke run only has to end before the session does.
NICENESS = 10


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


class SmokeRun:
    """``python -m experiments.transfer.run --smoke`` writing into a folder of its own."""

    def __init__(self, niceness: int = 0) -> None:
        self.out = Path(tempfile.mkdtemp(prefix="maec-smoke-"))
        self._logs = self.out.parent / f"{self.out.name}-logs"
        self._logs.mkdir()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self._logs / "stdout", "wb") as out, open(self._logs / "stderr", "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "experiments.transfer.run", "--smoke",
                 "--out", str(self.out)],
                cwd=ROOT, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=(lambda: os.nice(niceness)) if niceness else None)

    def wait(self, timeout: float) -> Finished:
        try:
            rc = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return Finished(rc, (self._logs / "stdout").read_text(errors="replace"),
                        (self._logs / "stderr").read_text(errors="replace"))

    def stop(self) -> None:
        """Stop the run (its whole process group) if it is still going; remove its files."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        shutil.rmtree(self.out, ignore_errors=True)
        shutil.rmtree(self._logs, ignore_errors=True)


# The session's run, when conftest started one early.
started: SmokeRun | None = None
