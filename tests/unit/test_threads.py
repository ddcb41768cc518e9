"""runtime/threads.py: which threads compute. A decode step runs on one thread where steps of its size run faster so
(measured as they run, per size), which changes no logit: a decode step's are the same on one thread as on two."""

from __future__ import annotations

import threading

import torch

from kvgate.runtime.decode import Batches
from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.threads import Teams, claim, switchable, team


def test_each_size_tries_both_teams_then_keeps_the_faster_and_tries_the_other_now_and_then() -> None:
    teams = Teams(2, tries=3, every=10)
    seconds = {1: 0.010, 2: 0.020}  # one thread faster
    picked = []
    for _ in range(40):
        threads = teams.pick(1)
        picked.append(threads)
        teams.took(1, threads, seconds[threads])
    assert sorted(picked[:6]) == [1, 1, 1, 2, 2, 2]  # both tried alike first
    assert [k for k, threads in enumerate(picked) if k >= 6 and threads == 2] == [10, 20, 30]  # every 10 steps
    assert teams.pick(3) in (1, 2) and teams.size(3) == teams.size(4) == 4 != teams.size(5)  # sizes apart
    for _ in range(3):  # the faster changes: two threads now win, once their latest steps say so
        teams.took(1, 1, 0.030)
    assert teams.steps[1] % 10 != 0 and teams.pick(1) == 2


def test_a_single_thread_engine_never_switches() -> None:
    teams = Teams(1)
    assert {teams.pick(rows) for rows in (1, 8, 64)} == {1}


def test_a_decode_steps_logits_are_the_same_on_one_thread_as_on_two(loaded: LoadedModel) -> None:
    model, c = loaded.model, loaded.model.config
    got: list[torch.Tensor] = []

    def step(threads: int) -> None:
        claim(2)
        team(threads)
        assert switchable() and torch.get_num_threads() == threads
        caches = []
        for b in range(3):
            kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, model.dtype, "cpu", 1024)
            forward(model, [Run(kv, [(7 * b + j) % 900 + 5 for j in range(20 + 9 * b)], 0)])
            caches.append(kv)
        got.append(forward(model, [Run(kv, [11], len(kv)) for kv in caches], pad=False, batches=Batches()))

    for threads in (1, 2):
        worker = threading.Thread(target=step, args=(threads,))  # claim() is for a thread of its own
        worker.start()
        worker.join()
    assert len(got) == 2 and torch.equal(got[0], got[1])
