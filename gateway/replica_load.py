"""What each replica says of its own load, read from its `/metrics`: requests running and waiting, and
how full its KV cache is (vLLM's, SGLang's and kvgate's names). A front counts only the requests it
sent; the replica's own figures count every front's, so two fronts over one fleet see one load: a
replica's load is this front's requests now, plus the others' as of the latest poll (what it reported
less what this front had there then: a report taken mid-request does not outlive the request).

A front polls every replica each `every_s` while it serves, where it has two or more to choose from. A
replica that does not answer, or whose text names none of these gauges (a hosted API), reports
nothing: the front's own count stands alone, and after `SILENT_POLLS` such polls in a row it is asked
again only after `QUIET_S` (one slow answer from a busy replica does not silence it). A report
older than `STALE_POLLS` polls is not believed either."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvgate.proxy")

# Each engine's gauge for the same figure (vLLM's KV usage has had two names).
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "kvgate_requests_running")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "kvgate_requests_waiting")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
STALE_POLLS = 3  # a report this many polls old is no longer believed
QUIET_S = 60.0  # a replica that keeps reporting nothing is asked again after this long
SILENT_POLLS = 3  # polls in a row without a report that make a replica quiet
TIMEOUT_S = 2.0  # a replica's /metrics that takes longer says nothing this poll
KV_FULL = 0.95  # a replica whose KV is this full evicts what a conversation left there: it counts as busy


@dataclass(frozen=True)
class Report:
    running: float
    waiting: float
    kv_usage: float | None  # 0..1; None: not exported (kvgate's KV lives in host memory and grows)
    at: float  # time.monotonic() when read
    own: int = 0  # this front's requests there when it was read

    @property
    def requests(self) -> int:
        return math.ceil(self.running + self.waiting)


def parse(text: str, now: float) -> Report | None:
    """The figures a `/metrics` text gives, summed over its label sets (a server may run several
    engines); the KV usage the fullest of them. None: it names neither running nor waiting requests."""
    sums: dict[str, float] = {}
    fullest: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value = float(sample.value)
                if not math.isfinite(value) or value < 0:
                    continue
                if sample.name in RUNNING or sample.name in WAITING:
                    sums[sample.name] = sums.get(sample.name, 0.0) + value
                elif sample.name in KV_USAGE:
                    fullest = max(fullest or 0.0, min(value, 1.0))
    except (ValueError, TypeError, IndexError):  # not Prometheus text: no report
        return None
    if not any(name in sums for name in (*RUNNING, *WAITING)):
        return None
    return Report(sum(sums.get(n, 0.0) for n in RUNNING), sum(sums.get(n, 0.0) for n in WAITING), fullest, now)


class ReplicaLoads:
    """The latest report of each replica, refreshed by a poll every `every_s` (0: never polled)."""

    def __init__(
        self,
        names: Sequence[str],
        scrape: Callable[[Sequence[str], float], Awaitable[dict[str, str]]],
        own: Callable[[str], int],
        every_s: float,
        spill_at: int,
    ) -> None:
        self.names, self.scrape, self.own, self.every_s, self.spill_at = list(names), scrape, own, every_s, spill_at
        self.reports: dict[str, Report] = {}
        self.silent: dict[str, int] = {}  # polls in a row each replica reported nothing
        self.quiet: dict[str, float] = {}  # replicas that kept reporting nothing: when to ask them again
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        """Poll from now on (on the running event loop), unless polling already or turned off."""
        if self.task is None and self.every_s > 0 and len(self.names) > 1:
            self.task = asyncio.get_running_loop().create_task(self.poll())

    async def poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a poll that fails leaves the reports to go stale; routing goes on
                log.exception("reading the replicas' load failed")
            await asyncio.sleep(self.every_s)

    async def refresh(self) -> None:
        asked = [n for n in self.names if self.quiet.get(n, 0.0) <= time.monotonic()]
        before = {n: self.own(n) for n in asked}
        texts = await self.scrape(asked, TIMEOUT_S)
        now = time.monotonic()
        for name in asked:
            if (report := parse(texts.get(name, ""), now)) is not None:
                # What this front had there while it was read (the most, so as not to count others twice).
                self.reports[name] = replace(report, own=max(before[name], self.own(name)))
                self.silent.pop(name, None)
            elif (silent := self.silent.get(name, 0) + 1) >= SILENT_POLLS:
                self.quiet[name], self.silent[name] = now + QUIET_S, 0
            else:
                self.silent[name] = silent

    def reported(self, name: str) -> Report | None:
        report = self.reports.get(name)
        if report is None or time.monotonic() - report.at > STALE_POLLS * max(self.every_s, 1.0):
            return None
        return report

    def load(self, name: str) -> int:
        """A replica's load: this front's requests there now, plus the other fronts' (and clients') as the
        replica last said; as busy as `proxy.spill_at` when its KV is nearly full."""
        own, report = self.own(name), self.reported(name)
        if report is None:
            return own
        full = self.spill_at if report.kv_usage is not None and report.kv_usage >= KV_FULL else 0
        return max(own + max(0, report.requests - report.own), full)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
