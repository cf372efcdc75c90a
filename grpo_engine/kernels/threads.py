"""How many torch threads a run uses: measured on the machine that runs it, not assumed.

torch starts with one thread per core it sees. That is not always the fastest count: on hybrid laptop CPUs
the efficiency cores hold the performance cores back at every barrier, on a shared or throttled machine some
cores are busy, and a GEMM that has saturated memory bandwidth gains nothing from more threads but the
synchronisation. So the count is chosen by timing a training-sized product of the model's largest projection
at 1, 2, 4, ... threads up to torch's default, keeping the largest count unless a smaller one is at least
`MARGIN` faster (timing noise must not cost a core). The choice is cached with the GEMM choices (select.py),
recorded in the kernel plan (RUN_DIR/kernels.json and every checkpoint) and restored on --resume: the thread
count changes the order of floating-point sums, so a resumed run needs the same one to repeat the
uninterrupted run bit for bit.

GRPO_THREADS=N fixes the count without measuring; so does OMP_NUM_THREADS (torch read it at start-up).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

AVAILABLE = torch.get_num_threads()  # torch's default, read before any choice made here changes it
MARGIN = 0.95  # a smaller count must take at most 95% of the largest count's time to be chosen
ROWS = 512  # rows of the timed product: a training-sized micro-batch slice
ENV = "GRPO_THREADS"
BUSY_LOAD = 0.5  # runnable threads of other work (1-minute average) that make a timing unfit to remember


def fixed_threads() -> int | None:
    """The thread count the user fixed (GRPO_THREADS, else OMP_NUM_THREADS), or None to measure."""
    value = os.environ.get(ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{ENV}={value!r} is not a thread count: set a positive integer, or unset it to let "
                             f"the engine measure the fastest count")
        return int(value)
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()
    return None


def candidates(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, and `limit` itself."""
    counts = [1]
    while counts[-1] * 2 < limit:
        counts.append(counts[-1] * 2)
    return sorted({*counts, max(1, limit)})


def measure(counts: list[int], time_product: Callable[[], float]) -> dict[int, float]:
    """Seconds of `time_product()` at each thread count; torch's count is restored afterwards."""
    previous = torch.get_num_threads()
    times = {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            times[n] = time_product()
    finally:
        torch.set_num_threads(previous)
    return times


def pick(times: dict[int, float]) -> int:
    """The largest count, unless a smaller one is at least 1 - MARGIN faster (then the fastest)."""
    most = max(times)
    fastest = min(times, key=times.get)
    return fastest if times[fastest] < MARGIN * times[most] else most


def others_busy() -> bool:
    """Whether other work shares the CPUs now: the 1-minute load average beyond this process's one busy thread is at
    least BUSY_LOAD. More threads then wait at every barrier on a core someone else holds, so the timing favours
    fewer threads than the machine can use: the count measured then serves this run but is not cached."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return False  # no load average on this OS: trust the timing
    return load - 1.0 >= BUSY_LOAD


def fix_threads(count: int) -> None:
    """Use `count` threads from now on in this process, and tell the kernel plan not to measure (GRPO_THREADS)."""
    os.environ[ENV] = str(count)
    torch.set_num_threads(count)
