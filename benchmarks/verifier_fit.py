"""`kvgate bench semantic --fit-verifier PATH`: fit the semantic cache's verifier (semantic_cache/verifier.py)
on the fit half of the QQP pairs (the bench's split: it never sees the test half), each pair asked both
ways. `--fit-verifier semantic_cache/verifier.npz` writes the one shipped."""

from __future__ import annotations

import numpy as np
import torch

from kvgate.bench.data import Pair
from kvgate.semantic_cache.policy import Classifier
from kvgate.semantic_cache.verifier import NAMES, Verifier, pair_features, rarity_table

HIDDEN = 64
EPOCHS = 300


def inputs(
    rows: list[tuple[str, str, float]], rarity: np.ndarray, categories: list[str], names: tuple[str, ...]
) -> np.ndarray:
    """Unstandardised features and the one-hot category of (query, cached, cosine) rows."""
    found = np.array([pair_features(q, c, cos, rarity) for q, c, cos in rows], np.float32)
    onehot = np.array([[n == c for n in names] for c in categories], np.float32)
    return np.concatenate([found, onehot], axis=1)


def fit_verifier(pairs: list[Pair], a: np.ndarray, b: np.ndarray, rows: np.ndarray, classify: Classifier) -> Verifier:
    """Fit on `rows` of the pairs, asked both ways (b given a, a given b)."""
    rarity = rarity_table([t for r in rows for t in pairs[r][:2]])
    names = tuple(c.name for c in classify.config.categories)
    cosine = (a[rows] * b[rows]).sum(1)
    asked = [(pairs[r][1], pairs[r][0], float(c)) for r, c in zip(rows, cosine, strict=True)]
    asked += [(pairs[r][0], pairs[r][1], float(c)) for r, c in zip(rows, cosine, strict=True)]
    kinds = [classify(pairs[r][1], b[r]).name for r in rows] + [classify(pairs[r][0], a[r]).name for r in rows]
    x = inputs(asked, rarity, kinds, names)
    y = np.concatenate([[p[2] for p in (pairs[r] for r in rows)]] * 2).astype(np.float32)
    n = len(NAMES)
    mean, scale = x[:, :n].mean(0), x[:, :n].std(0) + 1e-6
    x[:, :n] = (x[:, :n] - mean) / scale
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(HIDDEN, 1)
    )
    optimiser = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(EPOCHS):
        optimiser.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(xt).squeeze(1), yt)
        loss.backward()
        optimiser.step()
    first, last = net[0], net[3]
    return Verifier(
        rarity=rarity,
        categories=names,
        mean=mean,
        scale=scale,
        w1=first.weight.detach().numpy().T.copy(),
        b1=first.bias.detach().numpy().copy(),
        w2=last.weight.detach().numpy()[0].copy(),
        b2=float(last.bias.detach()[0]),
    )
