"""`python -m kvgate.bench.embedders` on a few hundred QQP-like pairs (tests/helpers/corpus.py): its section is written,
with a MiniLM row whose numbers parse and make sense."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(60)
def test_bench_embedders_writes_its_section(tmp_path: Path, qqp: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n<!-- bench:other -->\nkept\n<!-- /bench:other -->\n")
    args = [sys.executable, "-m", "kvgate.bench.embedders", "--data", str(qqp), "--limit", "200", "--output", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "kept" in text and "<!-- bench:embedders -->" in text and "<!-- /bench:embedders -->" in text
    assert "python -m kvgate.bench.embedders --data" in text and "The first 200 pairs" in text
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| gt-all")]
    assert len(rows) == 1
    dim, size, speed, auc, hard_auc, recall = rows[0][1:7]
    assert int(dim) == 384 and float(size) > 50 and float(speed.replace(",", "")) > 0
    assert 0.5 < float(auc) <= 1.0 and 0.0 <= float(hard_auc) <= 1.0 and 0.0 <= float(recall) <= 100.0
