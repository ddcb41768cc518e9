"""runtime/reuse_report.py: the reuse report is typed from the engine to the gateway, and said once, in the
x-kvgate-reuse and x-kvgate-fidelity headers as the SDKs read them back (kvgate.Reuse.from_headers)."""

from __future__ import annotations

from kvgate.gateway.choices import reuse_headers
from kvgate.runtime.reuse_report import NOTHING, Fidelity, ReuseReport
from kvgate.types import Reuse


def test_each_fidelity_is_said_as_the_header_says_it() -> None:
    assert str(Fidelity("exact")) == "exact"
    assert str(Fidelity("numerics")) == "numerics; kernels not split-invariant here; source=none"
    assert str(Fidelity("numerics", lossy_rows=10)) == "numerics; rows=10 decoded or read back lossy; source=none"
    assert str(Fidelity("unmeasured", 0.3)) == "ratio=0.3; source=none"
    calibrated = Fidelity("measured", 0.4, 0.0123, 0.975, source="calibration")
    assert str(calibrated) == "kl=0.0123; top1=0.975; ratio=0.4; source=calibration"
    checked = Fidelity("measured", 0.15, 0.01234, 0.9, 1.0, "shadow", 3)
    assert str(checked) == "kl=0.0123; top1=0.900; answer=1.000; ratio=0.15; source=shadow; checks=3"


def test_the_headers_say_the_report_and_the_sdk_reads_it_back() -> None:
    report = ReuseReport("blend", ("2 chunks found by content", ""), 120, 18, Fidelity("unmeasured", 0.15))
    headers = reuse_headers(report)
    assert headers["x-kvgate-reuse"] == "blend; 2 chunks found by content"
    read = Reuse.from_headers(headers)
    assert (read.mode, read.note, read.reused_tokens, read.recomputed_tokens) == (
        "blend",
        "2 chunks found by content",
        120,
        18,
    )
    assert read.fidelity == "ratio=0.15; source=none"


def test_nothing_reused_says_only_the_counts() -> None:
    assert reuse_headers(NOTHING) == {"x-kvgate-reused-tokens": "0", "x-kvgate-recomputed-tokens": "0"}
