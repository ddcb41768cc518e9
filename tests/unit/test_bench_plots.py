"""`kvgate bench ... --plot DIR`: each figure is drawn from a bench's results (small ones made here, no model) as
a PNG of a sane size, and the section written shows it right after the table it is drawn from."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

from kvgate.bench.engines_report import decode_figure, report
from kvgate.bench.engines_rows import decode_row
from kvgate.bench.prefill import batching
from kvgate.bench.ttft_lengths import shown
from kvgate.bench.ttft_report import ORDERS, Arm, Timing, frontier_figure, lines, tables
from kvgate.runtime.report import write_section
from kvgate.runtime.reuse import ReuseMode


def png(path: Path) -> tuple[int, int]:
    """A PNG's width and height (its IHDR chunk); the file is a PNG of a figure's size in bytes."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert 10_000 < len(data) < 1_000_000, len(data)
    width, height = struct.unpack(">II", data[16:24])
    assert 500 <= width <= 2000 and 300 <= height <= 1000, (width, height)
    return width, height


def shown_after_its_table(section: str, reference: str, first_row: str, out: Path) -> None:
    """Written as a section of the BENCHMARKS.md `out`, the image's markdown (`(reference)`) comes right after
    the table with a row beginning with `first_row`, a blank line between."""
    write_section(out, "plotted", "Plotted", "kvgate bench x --plot", section)
    lines = out.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("![") and line.endswith(f"({reference})"))
    table_end = max(i for i, line in enumerate(lines[:at]) if line.startswith("|"))
    assert (lines[table_end + 1], table_end + 2) == ("", at)
    start = table_end
    while lines[start - 1].startswith("|"):
        start -= 1
    assert any(line.startswith(f"| {first_row}") for line in lines[start : table_end + 1]), first_row


def timing(seconds: float, kl: float, top1: float) -> Timing:
    return Timing([seconds], [kl], [1.0], [top1], [100], [10])


def test_the_fidelity_frontier_has_a_line_per_selection_method(tmp_path: Path) -> None:
    arms = [Arm("full", ReuseMode("full")), Arm("prefix", ReuseMode("prefix")), Arm("naive", ReuseMode("naive"))]
    arms += [Arm(f"blend {r}%", ReuseMode("blend", r / 100), "deviation", r / 100) for r in (15, 30)]
    arms += [Arm(f"blend {r}%, select attention", ReuseMode("blend", r / 100), "attention", r / 100) for r in (30, 15)]
    drawn = {line: [a.name for a in members] for line, members in lines(arms).items()}
    assert drawn == {  # full prefill is the reference point, not a line; a line's points by ratio
        "prefix": ["prefix"],
        "naive": ["naive"],
        "deviation": ["blend 15%", "blend 30%"],
        "attention": ["blend 15%, select attention", "blend 30%, select attention"],
    }
    results = {order: {a.name: timing(1.0 + n, 0.1 / (n + 1), 0.8 + n / 100) for n, a in enumerate(arms)}
               for order in ORDERS}  # fmt: skip
    markdown = frontier_figure(results, arms, tmp_path / "ttft-frontier.png", tmp_path / "BENCHMARKS.md", "tiny")
    assert markdown.endswith("(ttft-frontier.png)")
    width, height = png(tmp_path / "ttft-frontier.png")
    assert width > height  # two panels side by side
    sections = tables(results, 1)
    section = sections[0] + "\n\n" + sections[1] + "\n\n" + markdown
    shown_after_its_table(section, "ttft-frontier.png", "blend 30%, select attention", tmp_path / "BENCHMARKS.md")


def test_kvgate_alone_decode_against_streams(tmp_path: Path) -> None:
    text = batching({1: 25.0, 2: 45.0, 4: 70.0, 8: 90.0, 16: 100.0}, 512, 32, 2, tmp_path / "img", tmp_path / "B.md")
    assert text.endswith("![decode tokens/s against sequences decoding together](img/prefill-concurrency.png)")
    png(tmp_path / "img" / "prefill-concurrency.png")
    shown_after_its_table(text, "img/prefill-concurrency.png", "16 | 100.0 | 4.00", tmp_path / "B.md")
    assert "![" not in batching({1: 25.0}, 512, 32, 2, None, tmp_path / "B.md")  # no --plot: no figure


def test_both_engines_decode_against_streams(tmp_path: Path) -> None:
    measured = {1: (52.0, 44.0), 8: (310.0, 196.0)}  # tokens/s, kvgate's and vLLM's
    rows = [replace(decode_row(n), values={"kvgate": [k, k + 2], "vllm": [v, v - 3]}) for n, (k, v) in measured.items()]
    decode_figure(rows, tmp_path / "engines-decode.png", "kvgate against vLLM")
    png(tmp_path / "engines-decode.png")
    section = report(rows, "where", 2, "![decode](engines-decode.png)")
    shown_after_its_table(section, "engines-decode.png", "decode, 8 streams, 64 tokens each", tmp_path / "B.md")


def test_ttft_against_prompt_length(tmp_path: Path) -> None:
    modes = ("full", "prefix", "naive", "blend")
    seconds = {n: {m: [n / 1000 / (i + 1)] for i, m in enumerate(modes)} for n in (512, 1024, 2048)}
    tokens = {n: n - 3.0 for n in seconds}
    text = shown(seconds, tokens, tmp_path, tmp_path / "BENCHMARKS.md", "tiny")
    png(tmp_path / "ttft-lengths.png")
    shown_after_its_table(text, "ttft-lengths.png", "2048 / 2045", tmp_path / "BENCHMARKS.md")
