"""`kvgate bench semantic` on a few hundred QQP-like pairs (tests/helpers/corpus.py): its section and plot are
written, and the numbers in its tables parse and make sense."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.bench.semantic_hit import bench_hit
from kvgate.gateway import cli
from kvgate.gateway.settings import Settings
from kvgate.semantic_cache.verifier import Verifier


def rows(text: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith(f"| {first}")]


@pytest.mark.timeout(120)
def test_bench_semantic_writes_its_section_and_plot(tmp_path: Path, qqp: Path, monkeypatch) -> None:
    """Run by the console script's body in this process (a process of its own spent ~8 s importing first)."""
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n<!-- bench:other -->\nkept\n<!-- /bench:other -->\n")
    args = ["bench", "semantic", "--limit", "240", "--traps", "20", "--sizes", "100,300", "--queries", "30"]
    args += ["--data", str(qqp)]  # never the shared QQP pairs: a clone has none
    args += ["--gateway", "0"]  # the model is not converted in this cache dir; see the test below
    args += ["--fit-verifier", str(tmp_path / "verifier.npz")]
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))  # embeddings cached there, not in ~/.cache
    assert cli.main([*args, "--output", str(out)]) == 0
    text = out.read_text()
    assert "kept" in text and "<!-- bench:semantic -->" in text and "<!-- /bench:semantic -->" in text
    assert "kvgate bench semantic --limit 240" in text and "(semantic-pr.png)" in text
    assert (tmp_path / "semantic-pr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "cache" / "bench").glob("semantic-*.npy"))  # embeddings kept for the next run
    # Precision, recall, F1 in [0, 100]; a lower threshold never has fewer hits.
    loose, strict = rows(text, "GPTCache-like")[0], rows(text, "RedisVL-like")[0]
    assert all(0.0 <= float(x) <= 100.0 for x in [*loose[1:4], *strict[1:4]])
    assert int(loose[4]) >= int(strict[4]) > 0
    # Paraphrases and traps: every percentage parses; the guards serve no more traps than no guards.
    plain, guarded = rows(text, "categories.yaml thresholds |")[1], rows(text, "categories.yaml thresholds + guards")[1]
    assert all(0.0 <= float(x) <= 100.0 for x in plain[1:] + guarded[1:] if x != "-")
    assert float(guarded[7]) <= float(plain[7])  # all synthetic traps
    # The verifier was fitted and written; the bound's rows, one per max_error_rate, parse.
    assert Verifier.load(tmp_path / "verifier.npz").score("Is tea good?", "Is tea healthy?", 0.8, "factual") > 0
    bounded = [r for r in rows(text, "QQP + synthetic traps") if len(r) == 14]
    assert [r[1] for r in bounded] == ["1%", "5%", "10%"]
    for r in bounded:  # shares, then hits, then the errors
        assert all(0.0 <= float(x) <= 100.0 for x in r[2:10] + r[11:]) and int(r[10]) >= 0
        assert float(r[11]) <= float(r[13])  # the first replay is one of those whose worst is shown
    # Latency at both sizes: p50 <= p99, all positive.
    sizes = [r for r in rows(text, "") if r[0].replace(",", "").isdigit() and " / " in r[1]]
    assert [int(r[0].replace(",", "")) for r in sizes] == [100, 300]
    for r in sizes:
        for cell in r[1:5]:
            p50, p99 = (float(x) for x in cell.split(" / "))
            assert 0.0 < p50 <= p99


def test_a_hit_through_the_gateway_is_timed_against_the_models_answer(settings: Settings, tmp_path: Path) -> None:
    body = bench_hit(settings, [("What is the capital of France?", "What's the capital city of France?")], 8, tmp_path)
    found = {r[0]: r for r in rows(body, "")}
    assert found["miss"][1] == found["hit (same question)"][1] == "1"
    speedup = float(found["hit (same question)"][4].removesuffix("x"))
    # A hit skips the model: measured 29.8x, 30.6x and 31.9x (2 cores, SmolLM2-135M); a third of that.
    assert speedup > 10
