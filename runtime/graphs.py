"""CUDA graphs of decode steps: a step's few hundred kernel launches replayed as one.

A decode step of a 32-layer model issues some forty kernels a layer; launched one by one from Python, the host
takes longer to issue them than a GPU takes to run them at small batches. A native decode batch
(runtime/decode.py) keeps every shape and address fixed for its shape, so the step is captured once per shape
and replayed for every later step of any batch of that shape, the new tokens copied into the graph's input.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Graphs kept (the least recently used dropped): one per batch shape in use.
MOST = 16


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # the input: the step's tokens
    out: torch.Tensor  # the output: their logits


class Graphs:
    """The captured steps of one engine (one owner: its thread); `step(ids)` is device ops alone."""

    def __init__(self, most: int = MOST) -> None:
        self.most = most
        self.captured: OrderedDict[tuple, Captured] = OrderedDict()
        self.pool: tuple | None = None  # one memory pool for all: their replays never overlap

    def run(self, key: tuple, tokens: list[int], step: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ids = torch.tensor(tokens, device="cpu").pin_memory()
        captured = self.captured.get(key)
        if captured is None:
            captured = self.capture(ids, step)
            self.captured[key] = captured
            while len(self.captured) > self.most:
                self.captured.popitem(last=False)
        else:
            self.captured.move_to_end(key)
            captured.ids.copy_(ids, non_blocking=True)
        captured.graph.replay()
        return captured.out.clone()  # the graph's output is overwritten by its next replay

    def capture(self, ids: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor]) -> Captured:
        device = torch.device("cuda", torch.cuda.current_device())
        static = ids.to(device)
        # Warm-up on a side stream, as capture wants (lazy inits, cuBLAS workspaces); a step's writes are its own
        # rows, so running it again before the replay changes nothing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(static)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA work (a tier's write-behind copying KV out) goes on during a capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step(static)
        return Captured(graph, static, out)

    def clear(self) -> None:
        self.captured.clear()
