"""Which thread computes on the cores.

torch's CPU kernels run on an OpenMP team of each calling thread. libgomp counts the threads of every team in
the process; once they outnumber the cores, each team waits between parallel regions by sleeping instead of
spinning, which doubled a decode step (measured: 2 cores, bf16, 25 against 51 ms) when the engine's thread and
any other thread (the HTTP loop's, a semantic-cache lookup's, the caller that loaded the model) had a team of
two. So the engine's thread claims the cores, and every other thread computes on one."""

from __future__ import annotations

import os
import threading

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
