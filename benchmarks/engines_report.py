"""What `kvgate bench engines` writes: where each engine computed (its cores, threads and dtype), and every row's runs
with their spread (median and min-max over the repeats, the gain as the median of per-repeat ratios),
prompt lengths and, for reuse rows, the fidelity against each engine's own full prefill."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from pathlib import Path

from kvgate.bench.engines_rows import ANSWER, ENGINES, Row
from kvgate.bench.plots import figure
from kvgate.runtime.report import table


def allowed(pid: int) -> set[int]:
    """The cores any thread of a process may run on (Linux: /proc/PID/task/*/status Cpus_allowed_list; an
    OpenMP runtime binds each of its threads to one core, so the process's own line tells only its first)."""
    cores: set[int] = set()
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            found = re.search(r"^Cpus_allowed_list:\s*(\S+)", status.read_text(), re.M)
        except OSError:
            continue
        for part in found.group(1).split(",") if found else ():
            low, _, high = part.partition("-")
            cores |= set(range(int(low), int(high or low) + 1))
    return cores


def ranges(cores: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"; "?" for none."""
    out: list[str] = []
    for c in sorted(cores):
        if out and int(out[-1].split("-")[-1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out) or "?"


def family(pid: int) -> list[int]:
    """The process and its descendants (Linux: /proc/*/stat)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, todo = [pid], [pid]
    while todo:
        this = todo.pop()
        kids = [p for p, parent in parents.items() if parent == this]
        found += kids
        todo += kids
    return found


def vllm_binding(log: str) -> str:
    """vLLM's own account of its dtype and OpenMP cores, from its log."""
    dtype = re.search(r"\bdtype=(torch\.\w+)", log)
    cores = re.findall(r"local_rank=\d+, core ids=(\[[^\]]*\])", log)
    bind = re.search(r"VLLM_CPU_OMP_THREADS_BIND='([^']*)'", log)
    return (
        f"dtype {dtype.group(1).removeprefix('torch.') if dtype else '?'}, OpenMP threads on cores "
        f"{', '.join(cores) or '?'} (VLLM_CPU_OMP_THREADS_BIND={bind.group(1) if bind else '?'})"
    )


def spread(values: list[float], unit: str) -> str:
    if not values:
        return "-"
    digits = 2 if unit == "s" else 1
    middle = statistics.median(values)
    return f"{middle:.{digits}f} {unit} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def gains(row: Row) -> list[float]:
    """Per repeat: how many times better kvgate is (vLLM's time over kvgate's, or kvgate's tokens/s over vLLM's)."""
    pairs = zip(row.values["kvgate"], row.values["vllm"])
    return [v / k if row.unit == "s" else k / v for k, v in pairs if k > 0 and v > 0]


def prompts(row: Row) -> str:
    """Both engines' prompt tokens (checked equal request by request as they ran)."""
    counts = row.prompts["kvgate"]
    if row.prompts["kvgate"] != row.prompts["vllm"]:  # Row.prompt stops the run first; this is a last guard
        return f"DIFFER: kvgate {row.prompts['kvgate']}, vLLM {row.prompts['vllm']}"
    return f"{min(counts)}-{max(counts)}, equal" if counts else "-"


def fidelity(row: Row, engine: str) -> str:
    if not row.reuse:
        return ""
    equal = row.equal[engine]
    return f"{sum(equal)} of {len(equal)}"


def decode_figure(rows: list[Row], picture: Path, title: str) -> None:
    """Decode tokens/s against concurrent streams, each engine's median with its min-max."""
    decode = sorted((r for r in rows if r.streams), key=lambda r: r.streams)
    streams = [r.streams for r in decode]
    with figure(picture, 1, (6.5, 4.2), title) as (ax,):
        for engine, colour in zip(ENGINES, ("tab:blue", "tab:orange")):
            values = [r.values[engine] for r in decode]
            middle = [statistics.median(v) if v else float("nan") for v in values]
            low = [m - min(v) if v else 0.0 for m, v in zip(middle, values)]
            high = [max(v) - m if v else 0.0 for m, v in zip(middle, values)]
            shown = "kvgate" if engine == "kvgate" else "vLLM"
            ax.errorbar(streams, middle, yerr=[low, high], fmt="o-", color=colour, capsize=3, label=shown)
        ax.set_xscale("log", base=2)
        ax.set_xticks(streams, [str(n) for n in streams])
        ax.set(xlabel="concurrent streams", ylabel="decode tokens/s, all streams (median, min-max)", ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def report(rows: list[Row], where: str, repeats: int, shown: str = "") -> str:
    """The section's text; `shown`: markdown put right after the table (its figure)."""
    lines = []
    for r in rows:
        g = gains(r)
        gain = f"{statistics.median(g):.2f}x [{min(g):.2f}-{max(g):.2f}]" if g else "-"
        k, v = r.values["kvgate"], r.values["vllm"]
        lines.append([r.name, spread(k, r.unit), spread(v, r.unit), f"{len(k)} / {len(v)}", gain, prompts(r),
                      fidelity(r, "kvgate"), fidelity(r, "vllm")])  # fmt: skip
    header = [
        "row",
        "kvgate: median [min-max]",
        "vLLM: median [min-max]",
        "runs (kvgate / vLLM)",
        "kvgate's gain: median [min-max] of per-run ratios (>1: kvgate faster)",
        "prompt tokens (both engines)",
        "kvgate: answers = its full prefill's",
        "vLLM: answers = its full prefill's",
    ]
    notes = [
        f"- {r.name}: kvgate served {served(r.served)}; x-kvgate-fidelity {served(r.fidelity)}"
        for r in rows
        if r.reuse or any(r.served)
    ]
    legend = (
        f"{repeats} repeat{'s' if repeats != 1 else ''} per row and engine, the engines alternating which goes "
        "first and the other paused (SIGSTOP) while one is measured. TTFT: from sending the request to the "
        f"first streamed content. A reuse row's answers ({ENGINES[0]} and vLLM each, greedy, {ANSWER} tokens) "
        "are compared with that engine's own full prefill of the very prompt: kvgate's `reuse: full`, vLLM's "
        "request under a fresh `cache_salt`. Prompt tokens: each engine's own usage count, checked equal for "
        "every request (the run stops otherwise)."
    )
    after = f"{shown}\n\n" if shown else ""
    return f"{where}\n\n{legend}\n\n{table(header, lines)}\n\n{after}" + "\n".join(notes) + "\n"


def served(values: list[str]) -> str:
    """Distinct header values with how many requests had each: `"blend; 6 documents" x3, "exact" x2`."""
    counted = Counter(v or "(none)" for v in values)
    return ", ".join(f"`{value}` x{n}" for value, n in counted.most_common()) or "-"
