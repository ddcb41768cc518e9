"""benchmarks/agents.py: the live table pools a policy's workloads and shows each one's ratio, and a live run
alone keeps a section of its own (the live runs take minutes a policy: `kvgate bench agents`, not a test)."""

from __future__ import annotations

from pathlib import Path

from kvgate.bench.agents import BASELINE, HEADER, Policy, Run, rows, section
from kvgate.runtime.report import write_section


def run(jct: list[float], makespan: float, evictions: int = 3) -> Run:
    return Run(
        jct=jct, makespan=makespan, prompt_tokens=100, reused_tokens=50, turns=4, pinned_turns=1, evictions=evictions
    )


def test_a_policy_row_pools_its_workloads_and_shows_each_ratio() -> None:
    decided = Policy("decide", "program")
    runs = {
        BASELINE: [run([10.0, 10.0], 20.0), run([30.0, 30.0], 40.0)],
        decided: [run([5.0, 5.0], 10.0), run([10.0, 10.0], 30.0, evictions=-1)],
    }
    base, mine = (dict(zip(HEADER, row, strict=True)) for row in rows(runs))
    assert base["mean JCT vs off + fcfs"] == "1.00x" and base["each workload's"] == "1.00x / 1.00x"
    assert mine["policy"] == "decide + program"
    assert mine["mean JCT (s)"] == "7.5" and mine["makespan (s)"] == "20.0"
    assert mine["mean JCT vs off + fcfs"] == "2.67x"  # 20 s against 7.5 s pooled, not the mean of 2x and 3x
    assert mine["each workload's"] == "2.00x / 3.00x"
    assert mine["prompt reused"] == "50%" and mine["pinned"] == "2/8"
    assert base["memory evictions"] == "6" and mine["memory evictions"] == "?"  # one workload's count is missing


def test_a_live_run_alone_keeps_a_section_of_its_own(tmp_path: Path) -> None:
    output = tmp_path / "BENCHMARKS.md"
    write_section(output, *section(30, simulated=True), "kvgate bench agents --programs 30", "default run")
    write_section(output, *section(100, simulated=False), "kvgate bench agents --programs 100 ...", "live alone")
    write_section(output, *section(30, simulated=True), "kvgate bench agents --programs 30", "default again")
    text = output.read_text()
    assert "<!-- bench:agents -->" in text and "<!-- bench:agents-live-100 -->" in text
    assert "live alone" in text and "default again" in text and "default run" not in text
