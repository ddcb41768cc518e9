"""gateway/replica_load.py: a replica's own load, read from its /metrics in vLLM's, SGLang's or kvgate's
names (the texts below are in each engine's exposition format, as their servers write it); what a
front believes of it, and for how long. Routing on it, with real replicas: tests/server/test_fleet.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from kvgate.gateway.replica_load import QUIET_S, SILENT_POLLS, STALE_POLLS, ReplicaLoads, Report, parse

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""
SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 2.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.97
"""
KVGATE = """\
# HELP kvgate_requests_waiting sequences waiting for the engine
# TYPE kvgate_requests_waiting gauge
kvgate_requests_waiting 1.0
# HELP kvgate_requests_running sequences the engine is running
# TYPE kvgate_requests_running gauge
kvgate_requests_running 4.0
"""


def test_each_engines_names_are_read_and_summed_over_its_engines() -> None:
    assert parse(VLLM, 7.0) == Report(running=4.0, waiting=2.0, kv_usage=0.5, at=7.0)
    assert parse(SGLANG, 7.0) == Report(running=2.0, waiting=0.0, kv_usage=0.97, at=7.0)
    assert parse(KVGATE, 7.0) == Report(running=4.0, waiting=1.0, kv_usage=None, at=7.0)


@pytest.mark.parametrize(
    "text",
    [
        "",  # a server without metrics
        "<html>not found</html>",  # a 200 that is no Prometheus text
        "# TYPE other_gauge gauge\nother_gauge 3\n",  # metrics, none of a load
        'vllm:num_requests_running{model_name="m"} NaN\n',  # nothing believable
    ],
)
def test_a_text_naming_no_load_is_no_report(text: str) -> None:
    assert parse(text, 0.0) is None


def loads(texts: dict[str, str], own: dict[str, int]) -> ReplicaLoads:
    """Replicas a, b, c saying `texts`; this front's requests at each as `own` says (changed by the test)."""

    async def scrape(names, timeout_s):
        return {n: texts[n] for n in names if n in texts}

    return ReplicaLoads(["a", "b", "c"], scrape, lambda name: own.get(name, 0), 1.0, spill_at=4)


def test_a_replica_is_as_loaded_as_every_front_makes_it_and_as_busy_as_spill_at_when_its_kv_is_full() -> None:
    own = {"a": 1, "c": 2}
    found = loads({"a": VLLM, "b": SGLANG}, own)
    asyncio.run(found.refresh())  # a says 6 (4 running, 2 waiting), 1 of them this front's
    assert found.load("a") == 6
    own["a"] = 3  # two more sent since: the others' 5 as last said, and this front's 3 now
    assert found.load("a") == 8
    own["a"] = 0  # this front's request ended since the poll: a report taken meanwhile does not outlive it
    assert found.load("a") == 5
    assert found.load("b") == 4  # 2 running, but its KV 97% full: as busy as spill_at
    assert found.load("c") == 2  # no report (no answer): this front's count


def test_a_replica_that_reports_nothing_is_asked_again_only_after_a_while() -> None:
    asked: list[list[str]] = []

    async def scrape(names, timeout_s):
        asked.append(list(names))
        return {"a": VLLM, "b": "<html>a hosted API's 404</html>"}

    found = ReplicaLoads(["a", "b", "c"], scrape, lambda name: 0, 1.0, spill_at=4)
    for _ in range(SILENT_POLLS):  # a slow answer or two from a busy replica silence nothing
        asyncio.run(found.refresh())
    asyncio.run(found.refresh())
    assert asked == [["a", "b", "c"]] * SILENT_POLLS + [["a"]]
    found.quiet = {name: at - QUIET_S for name, at in found.quiet.items()}  # the while has passed
    asyncio.run(found.refresh())
    assert asked[-1] == ["a", "b", "c"]


def test_a_report_goes_stale_after_a_few_polls() -> None:
    found = loads({"a": VLLM}, {"a": 1})
    asyncio.run(found.refresh())
    found.reports["a"] = replace(found.reports["a"], at=time.monotonic() - STALE_POLLS - 0.1)
    assert found.load("a") == 1


def test_polling_runs_while_the_front_serves_and_stops_when_it_closes() -> None:
    calls = []

    async def scrape(names, timeout_s):
        calls.append(names)
        return {"a": KVGATE}

    async def serve() -> None:
        found = ReplicaLoads(["a", "b"], scrape, lambda name: 0, 0.05, spill_at=4)
        found.start()
        found.start()  # one poller, however often a request starts it
        await asyncio.sleep(0.3)
        assert 3 <= len(calls) <= 8 and found.load("a") == 5
        await found.close()
        polled = len(calls)
        await asyncio.sleep(0.2)
        assert len(calls) == polled
        offs = [
            ReplicaLoads(names, scrape, lambda name: 0, every, spill_at=4)
            for names, every in ((["a", "b"], 0.0), (["a"], 1.0))
        ]
        for off in offs:
            off.start()  # turned off; or one replica: nothing to choose between
            assert off.task is None

    asyncio.run(serve())
