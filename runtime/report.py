"""Write one section of a BENCHMARKS.md (a benchmark's, `kvgate calibrate --report`'s), keeping the others."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch


def machine() -> str:
    return f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def write_section(path: Path, name: str, title: str, command: str, body: str) -> None:
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = (
        f"{begin}\n## {title}\n\n`{command}`\n\n{time.strftime('%Y-%m-%d')}, {machine()}.\n\n{body.strip()}\n{end}"
    )
    text = (
        path.read_text()
        if path.exists()
        else "# Benchmarks\n\nEach section: the command that produced it, then its numbers.\n"
    )
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pct(x: float) -> str:
    """A fraction as a percentage with one decimal: 0.1234 -> "12.3"."""
    return f"{100 * x:.1f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
