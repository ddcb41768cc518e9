"""Write one section of a BENCHMARKS.md (a benchmark's, `kvgate calibrate --report`'s), keeping the others."""

from __future__ import annotations

import os
import platform
import re
import time
from pathlib import Path

import torch

from kvgate.runtime.threads import CORES

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # what decides bf16's speed on a CPU


def cpu() -> str:
    """The CPU by name and which of CPU_FLAGS it has (Linux: /proc/cpuinfo; elsewhere the machine's arch)."""
    info = Path("/proc/cpuinfo")
    text = info.read_text(errors="replace") if info.is_file() else ""
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    listed = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    flags = set(listed.group(1).split()) if listed else set()
    logical = len(re.findall(r"^processor\s*:", text, re.M)) or os.cpu_count()
    shown = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in CPU_FLAGS) if listed else "flags unknown"
    return f"CPU: {name.group(1).strip() if name else platform.machine()}, {logical} logical CPUs; {shown}"


def machine() -> str:
    flags = cpu().partition("; ")[2]
    return f"{platform.machine()} ({flags}), {CORES} cores for torch, torch {torch.__version__}"


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
