"""An entry arriving from a lower tier layer by layer, so its first layers are used while the
rest is still being read (the blend recomputes layer i while layer i+1 loads)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

import torch

from kvgate.chunk_cache.byte_tier import ByteTier, Read
from kvgate.chunk_cache.entry import ChunkKV, CorruptEntry, Header


class LoadFailed(RuntimeError):
    """The entry could not be read whole (damaged, or its tier failed): recompute it instead."""


class Loading:
    def __init__(
        self,
        tier: ByteTier,
        header: Header,
        read: Read,
        pool: Executor,
        done: Callable[[ChunkKV], object] | None = None,
    ) -> None:
        """Reads every layer of `header`'s entry in `pool`; `done` gets the whole entry."""
        self.tier, self.header, self.key, self.token_ids = tier, header, header.key, header.token_ids
        self.kv = torch.empty(header.kv_shape, dtype=header.dtype)
        self._ready = 0
        self._error: Exception | None = None
        self._cond = threading.Condition()
        self._wanted: list[int] = []  # the layers waiters wait for: a layer read wakes only theirs
        self._done = done
        self.finished: Future[None] = pool.submit(self._run, read)  # done after `done` has run too

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values [kv_heads, T, head_dim], once read and checked."""
        with self._cond:
            self._wanted.append(i)
            try:
                self._cond.wait_for(lambda: self._ready > i or self._error is not None)
            finally:
                self._wanted.remove(i)
            if self._ready <= i:
                raise LoadFailed(f"chunk {self.key} from tier {self.tier.name}: {self._error}") from self._error
        return self.kv[i, 0], self.kv[i, 1]

    def result(self) -> ChunkKV:
        """The whole entry; raises LoadFailed."""
        self.layer(self.header.layers - 1)
        return self.header.entry(self.kv)

    def _run(self, read: Read) -> None:
        try:
            for i in self.tier.layers(self.header, read, self.kv):
                with self._cond:
                    self._ready = i + 1
                    if i in self._wanted:  # a wake-up per layer read costs the reader the GIL
                        self._cond.notify_all()
        except Exception as e:
            if isinstance(e, CorruptEntry):
                self.tier.discard(self.key, e)
            else:
                self.tier.failed("reading", self.key, e)
            with self._cond:
                self._error = e
                self._cond.notify_all()
            return
        self.tier.loaded(self.header)
        if self._done is not None:
            self._done(self.header.entry(self.kv))
