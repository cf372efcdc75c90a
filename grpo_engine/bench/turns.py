"""Step-by-step turns between benchmark processes, so that two engines' steps alternate on one machine.

Why: a shared or virtual machine's speed drifts by 10-30% over minutes (docs/benchmarks.md), and two engines
timed one after the other see different machines. When a driver (benchmarks/step_vs_trl.py) runs both at once
and lets only one step run at a time, ours and the peer's steps alternate, each pair of steps sees the same
machine, and the ratio of each pair is meaningful.

The protocol, over two pipe ends the driver hands to the process (`--turn-fds READ,WRITE`): before each timed
step the process writes b"R" (ready: its previous step, and whatever it did after it, is over) and blocks until
it reads one byte. Its last step's turn ends when it exits (the driver reads end-of-file), so the work it does
after its last step (ours measures the GEMM rate of the matmul floor) is still alone on the machine.
"""

from __future__ import annotations

import os


class TurnError(RuntimeError):
    """The driver that gives the turns went away, or handed over descriptors that do not work."""


class StepTurns:
    """The process side: `wait()` before each timed step."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd, self.write_fd = read_fd, write_fd

    @classmethod
    def parse(cls, spec: str) -> StepTurns:
        """From "READ,WRITE": two inherited file descriptors (integers)."""
        try:
            read_fd, write_fd = (int(part) for part in spec.split(","))
        except ValueError:
            raise TurnError(f"--turn-fds {spec!r}: give two inherited file descriptors as READ,WRITE, "
                            f"e.g. 5,6") from None
        for fd in (read_fd, write_fd):
            try:
                os.fstat(fd)
            except OSError:
                raise TurnError(f"--turn-fds {spec!r}: descriptor {fd} is not open in this process; the driver "
                                f"must pass it (subprocess pass_fds)") from None
        return cls(read_fd, write_fd)

    def wait(self) -> None:
        """Say ready, then block until the driver gives the turn."""
        try:
            os.write(self.write_fd, b"R")
            got = os.read(self.read_fd, 1)
        except OSError as e:
            raise TurnError(f"the benchmark driver's turn pipe failed ({e}); did the driver exit?") from e
        if not got:
            raise TurnError("the benchmark driver closed its turn pipe before giving this process its turn")
