"""Which category a question belongs to, and the similarity a hit needs there right now."""

from __future__ import annotations

import re

import numpy as np

from kvgate.semantic_cache.config import Category, SemanticCacheConfig
from kvgate.semantic_cache.embedder import Embedder


class Classifier:
    """The first category whose pattern matches; else the category of the nearest prototype question,
    when it is close enough; else the default category."""

    def __init__(self, config: SemanticCacheConfig, embedder: Embedder) -> None:
        self.config = config
        self.rules = [(c, [re.compile(p, re.IGNORECASE) for p in c.patterns]) for c in config.categories]
        prototypes = [(c, text) for c in config.categories for text in c.prototypes]
        self.owners = [c for c, _ in prototypes]
        self.prototypes = (
            embedder.embed([t for _, t in prototypes]) if prototypes else np.zeros((0, embedder.dim), np.float32)
        )

    def __call__(self, query: str, vector: np.ndarray) -> Category:
        for category, patterns in self.rules:
            if any(p.search(query) for p in patterns):
                return category
        if len(self.owners):
            similarities = self.prototypes @ vector
            best = int(np.argmax(similarities))
            if similarities[best] >= self.config.prototype_similarity:
                return self.owners[best]
        return self.config.fallback


def threshold(category: Category, config: SemanticCacheConfig, queued: int) -> float:
    """The category's threshold, relaxed by up to `relax_step` as the queue grows, never below its floor."""
    load = min(1.0, queued / config.queue_long) if config.queue_long > 0 else 0.0
    return max(category.floor, category.threshold - config.relax_step * load)
