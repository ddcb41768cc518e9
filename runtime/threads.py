"""Which thread computes on the cores.

torch's CPU kernels run on an OpenMP team of each calling thread. libgomp counts the threads of every team in
the process; once they outnumber the cores, each team waits between parallel regions by sleeping instead of
spinning, which doubled a decode step (measured: 2 cores, bf16, 25 against 51 ms) when the engine's thread and
any other thread (the HTTP loop's, a semantic-cache lookup's, the caller that loaded the model) had a team of
two. So the engine's thread claims the cores, and every other thread computes on one."""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# torch's default: OMP_NUM_THREADS, else the cores this process may run on.
CORES = int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))


def hand_over() -> None:
    """The calling thread, and every thread that starts computing from now on, computes on one core. A thread
    that has computed on more before keeps its team (libgomp frees it when the thread ends)."""
    torch.set_num_threads(1)


def claim(threads: int = 0) -> None:
    """The calling thread computes on `threads` cores (0: CORES); threads that start computing from now on, on
    one."""
    torch.get_num_threads()  # a thread's first call sets it to the count new threads start with: before this
    torch.set_num_threads(threads or CORES)
    # torch.set_num_threads sets the caller's team and the one a new thread starts with: the latter back to one.
    other = threading.Thread(target=hand_over, name="kvgate-one-thread")
    other.start()
    other.join()


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """torch's OpenMP runtime (loaded with it under this name), or None where torch has another."""
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


def switchable() -> bool:
    """Whether `team` can set a thread's team here (torch's OpenMP runtime is libgomp)."""
    return _openmp() is not None


def team(threads: int) -> None:
    """The calling thread's next parallel regions run on `threads` threads (where `switchable`). Not
    torch.set_num_threads, which also sets the count every new thread starts with (see `claim`)."""
    runtime = _openmp()
    if runtime is not None:
        runtime.omp_set_num_threads(threads)


class Teams:
    """How many threads a decode step computes on: all the engine's, or one where one is faster for steps of that
    many rows. Measured as steps run, per size (rows to the next power of two): a small step's ops each cost more in
    the second thread's wake-up than they save, the more so where the HTTP loop shares the cores (the default model
    on 2 cores, bf16, one sequence: 25.6-26.2 ms a step on one thread, 27.1-28.6 on two; eight: 30.5-30.8 against
    29.2-29.8). Each size tries both `tries` times, then keeps the faster by the median of its last `tries` steps,
    trying the other again every `every` steps of that size."""

    def __init__(self, threads: int, tries: int = 5, every: int = 200) -> None:
        self.threads, self.tries, self.every = threads, tries, every
        self.times: dict[tuple[int, int], list[float]] = {}  # (size, threads) -> the latest step times
        self.steps: dict[int, int] = {}  # size -> steps taken

    @staticmethod
    def size(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def pick(self, rows: int) -> int:
        if self.threads == 1:
            return 1
        size = self.size(rows)
        one, every = self.times.get((size, 1), []), self.times.get((size, self.threads), [])
        if len(one) < self.tries or len(every) < self.tries:
            return 1 if len(one) <= len(every) else self.threads
        faster = 1 if statistics.median(one) < statistics.median(every) else self.threads
        other = self.threads if faster == 1 else 1
        return other if self.steps.get(size, 0) % self.every == 0 else faster

    def took(self, rows: int, threads: int, seconds: float) -> None:
        size = self.size(rows)
        self.steps[size] = self.steps.get(size, 0) + 1
        times = self.times.setdefault((size, threads), [])
        times.append(seconds)
        del times[: -self.tries]

    @contextmanager
    def sized(self, rows: int | None) -> Iterator[None]:
        """Compute a step of `rows` rows on the team that size runs fastest on, timed for the choice (None: all
        the threads, not timed)."""
        threads = self.threads if rows is None else self.pick(rows)
        team(threads)
        start = time.perf_counter()
        try:
            yield
        finally:
            team(self.threads)
        if rows is not None:
            self.took(rows, threads, time.perf_counter() - start)
