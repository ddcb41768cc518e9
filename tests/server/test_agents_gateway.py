"""Agent programs through the gateway: a real uvicorn server, the real model, the openai SDK."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from kvgate.chunk_cache import ChunkCacheConfig, ChunkStore, DiskTier, MemoryTier
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from tests.helpers import loopback
from tests.helpers.servers import serving
from tests.helpers.waiting import wait_until

# `<|im_start|>system\nYou are a`: what prompts with a new system prompt share with a tenant's earlier ones.
OPENING = 6
SYSTEM = "You are a coding agent. Use the tools you are given, one call at a time."
TASK = "Find where the configuration file is read and report its path."
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def url(settings: Settings, loaded) -> Iterator[str]:
    """A server over an engine of this module's own, as the session's is built: the KVCOMM anchors its
    tests count are learnt here alone (an engine owns its anchor pool)."""
    engine = Engine(settings.engine_config(), loaded)
    agents = Settings(
        engine={"max_num_seqs": 4}, semantic_cache={"enabled": False}, agents={"pins": "fixed", "fixed_ttl_s": 60}
    )
    try:
        with serving(agents, engine) as base:
            yield base
    finally:
        engine.shutdown()


def client(url: str, key: str = "agent-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def turn(url: str, messages: list, program: str | None, key: str = "agent-key", **kw):
    headers = {"x-kvgate-program-id": program} if program else None
    return client(url, key).chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        temperature=0,
        extra_headers=headers,
        **{"tools": TOOLS, "max_tokens": 8, **kw},
    )


def busy_until(stop: threading.Event, url: str, key: str) -> int:
    """A long request of no program, streamed until `stop` is set, when the client hangs up (and the server
    stops it); the chunks it read."""
    chunks = 0
    with client(url, key).chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Count."}],
        max_tokens=512,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as stream:
        for _ in stream:
            chunks += 1
            if stop.is_set():
                break
    return chunks


def after_tool_call(first: list, answer: str, result: str) -> list:
    call = {"id": "call-1", "type": "function", "function": {"name": "search", "arguments": '{"q": "config"}'}}
    return [
        *first,
        {"role": "assistant", "content": answer, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": result},
    ]


def test_a_second_turn_within_the_ttl_reuses_the_whole_previous_context(url: str) -> None:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    raw = turn(url, first, "program-reuse")
    one = raw.parse()
    assert raw.headers["x-kvgate-program-id"] == "program-reuse"
    assert float(raw.headers["x-kvgate-pin-ttl"]) == 60
    assert raw.headers["x-kvgate-reused-tokens"] == "0"

    messages = after_tool_call(first, one.choices[0].message.content, "config.py:12: open('settings.yaml')")
    raw = turn(url, messages, "program-reuse")
    two = raw.parse()
    # Everything the first turn computed: its prompt, and its answer but the last token (whose KV
    # is computed only when it is fed back).
    assert int(raw.headers["x-kvgate-reused-tokens"]) == one.usage.prompt_tokens + one.usage.completion_tokens - 1
    assert two.usage.prompt_tokens_details.cached_tokens == int(raw.headers["x-kvgate-reused-tokens"])
    # The answer's rows were computed by decode steps, not as a prefill of them would: read, not called exact.
    assert raw.headers["x-kvgate-reuse"] == "program"
    assert raw.headers["x-kvgate-fidelity"].startswith("numerics; rows=")
    # Its prompt's rows are the full prefill's; the answer's move it by at most a rounding.
    truth = turn(url, messages, None).parse()
    assert two.choices[0].message.content == truth.choices[0].message.content


def test_another_tenant_never_continues_a_program_of_the_same_name(url: str) -> None:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}]
    one = turn(url, first, "shared-name", key="tenant-a").parse()
    messages = after_tool_call(first, one.choices[0].message.content, "a.py b.py")
    raw = turn(url, messages, "shared-name", key="tenant-b")
    assert raw.headers["x-kvgate-reused-tokens"] == "0"


def test_the_program_id_may_come_in_the_body(url: str) -> None:
    first = [{"role": "user", "content": "Count the tests."}]
    raw = turn(url, first, None, extra_body={"kvgate": {"program_id": "from-body"}})
    assert raw.headers["x-kvgate-program-id"] == "from-body"
    raw = turn(url, first, None)  # with tools but no id: a program of its own a later turn may continue
    assert raw.headers["x-kvgate-program-id"].startswith("conv-")
    raw = turn(url, first, None, tools=None)  # neither tools nor a history: nothing will continue it
    assert "x-kvgate-program-id" not in raw.headers


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({"x-kvgate-program-id": "bad id with spaces"}, {}, "x-kvgate-program-id"),
        ({"x-kvgate-program-id": "a"}, {"kvgate": {"program_id": "b"}}, "x-kvgate-program-id"),
        ({}, {"kvgate": {"program_id": "x" * 257}}, "kvgate.program_id"),
    ],
)
def test_a_bad_program_id_is_a_400_naming_what_the_caller_sent(url: str, headers: dict, body: dict, param: str) -> None:
    """A header by its name, a body field by its path: never a field the caller did not send."""
    payload = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], **body}
    r = loopback.post(f"{url}/v1/chat/completions", json=payload, headers=headers, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param


def test_a_pin_holds_until_its_ttl_then_the_context_moves_to_disk(engine: Engine, tmp_path: Path) -> None:
    """A server of its own whose chunk store has a disk tier below memory."""
    store = ChunkStore.from_config(
        ChunkCacheConfig(tiers=("memory", "disk"), memory_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    )
    shared, engine.reuser.store = engine.reuser.store, store
    settings = Settings(
        engine={"max_num_seqs": 4}, semantic_cache={"enabled": False}, agents={"pins": "fixed", "fixed_ttl_s": 1.5}
    )
    try:
        with serving(settings, engine) as base:
            messages = [{"role": "user", "content": "Run the tests."}]
            # "prefix": the program's own context only, so no shared message is stored beside it.
            raw = turn(base, messages, "program-ttl", key="ttl-key", extra_body={"kvgate": {"reuse": "prefix"}})
            memory, disk = store.tiers
            assert isinstance(memory, MemoryTier) and isinstance(disk, DiskTier)
            kept = memory.keys()  # the store is new: the turn's context is all it holds
            assert len(kept) == 1 and memory.stats()["pinned"] == 1
            expiry = time.monotonic() + 1.5
            time.sleep(1.0)
            assert kept[0] in memory and memory.stats()["pinned"] == 1  # still pinned, still in memory
            wait_until(lambda: kept[0] not in memory, 3.5, "the pin was not demoted after its TTL")
            assert time.monotonic() >= expiry - 0.1
            store.flush()
            assert kept[0] in disk
            assert raw.headers["x-kvgate-pin-ttl"] == "1.500"
    finally:
        engine.reuser.store = shared
        store.close()


SOLVER = "You are a careful math tutor. Solve the problem step by step."
CHECKER = "You are a strict reviewer. Check the solution above and give the final number."
QUESTIONS = [
    "A quilt takes 2 rolls of red cloth and half that much grey cloth. How many rolls in total does it take?",
    "Mira buys a boat for $9,000 and spends $4,000 mending it. How much did the boat cost her in all?",
    "Each morning, Tobin gives each of his 12 goats two scoops of oats. How many scoops is that a day?",
]


def test_a_second_agent_reuses_the_question_and_the_first_agents_answer(url: str, loaded) -> None:
    """Two agents with their own system prompts, a new pair of programs per task: the checker's
    request holds the question and the solver's answer as plain messages. Once each has been read
    once (its anchor learnt from that dense prefill), the checker's requests of later tasks reuse
    their KV from the solver's: anchors know an agent by its prefix, not by its program id."""
    count = lambda text: len(loaded.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    for i, question in enumerate(QUESTIONS):
        solver = [{"role": "system", "content": SOLVER}, {"role": "user", "content": question}]
        answer = turn(url, solver, f"task-{i}-solver", max_tokens=24, tools=None).parse().choices[0].message.content
        checker = [
            {"role": "system", "content": CHECKER},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Your turn: is the answer above right?"},
        ]
        raw = turn(url, checker, f"task-{i}-checker", tools=None)
        reused = int(raw.headers["x-kvgate-reused-tokens"])
        assert raw.parse().usage.prompt_tokens_details.cached_tokens == reused
        if i == 0:  # nothing learnt yet: computed densely, and learnt
            assert reused < count(question) and "no close anchor" in raw.headers["x-kvgate-reuse"]
        else:
            assert reused >= count(question) + count(answer), raw.headers["x-kvgate-reuse"]
            assert raw.headers["x-kvgate-reuse"].startswith("kvcomm")
            assert "source=" in raw.headers["x-kvgate-fidelity"]  # spans moved it: by how much, or unmeasured
    metrics = loopback.get(f"{url}/metrics").text
    assert "kvgate_kvcomm_estimates_total" in metrics
    # Another tenant's agents share none of it: spans hold their first reader's context (what it reads is
    # at most the chat template's opening that its own earlier prompts began with: its prefix blocks).
    raw = turn(url, checker, "task-other-checker", key="tenant-b", tools=None)
    assert int(raw.headers["x-kvgate-reused-tokens"]) <= OPENING
    assert not raw.headers.get("x-kvgate-reuse", "").startswith("kvcomm")


def test_prefix_reuse_keeps_a_program_to_its_own_context(url: str) -> None:
    solver = [{"role": "system", "content": SOLVER}, {"role": "user", "content": QUESTIONS[0]}]
    answer = turn(url, solver, "prefix-solver", tools=None).parse().choices[0].message.content
    checker = [{"role": "system", "content": CHECKER}, {"role": "user", "content": QUESTIONS[0]}]
    checker.append({"role": "assistant", "content": answer})
    reuses = []
    for _ in range(2):
        raw = turn(url, checker, "prefix-checker", tools=None, extra_body={"kvgate": {"reuse": "prefix"}})
        reuses.append(raw.headers.get("x-kvgate-reuse"))
    # The solver's answer is not looked up (the first turn reads at most the prefix blocks the previous
    # test's checker left: the same system prompt and question); its own context is.
    assert reuses[0] in (None, "prefix") and reuses[1] == "program"


def test_spans_stay_within_a_tenant_even_where_documents_are_shared(engine: Engine) -> None:
    """`caches.tenant_scoped: false` shares documents, computed alone; a span's KV holds its first
    reader's context, so spans stay with their tenant."""
    settings = Settings(engine={"max_num_seqs": 4}, semantic_cache={"enabled": False}, caches={"tenant_scoped": False})
    # No other test's: nobody has its KV. Long enough that reusing it pays (the cost model prices spans).
    system = (
        "You answer questions about tenants, and nothing else. A tenant is a team that holds its own keys, "
        "its own limits and its own cached text; no tenant ever reads what another tenant wrote or was told. "
        "When a question names no tenant, ask which one it means; when it names two, answer for each apart."
    )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which tenant asks this?"}]
    with serving(settings, engine) as base:
        turn(base, messages, "first-agent", key="tenant-a", tools=None)
        raw = turn(base, messages, "other-agent", key="tenant-b", tools=None)
        assert int(raw.headers["x-kvgate-reused-tokens"]) <= OPENING  # its own prompts' opening at most
        raw = turn(base, messages, "same-agent", key="tenant-a", tools=None)  # exact spans: its own tenant's
        assert int(raw.headers["x-kvgate-reused-tokens"]) > 0


def test_a_new_program_waits_while_the_programs_in_flight_fill_memory(settings: Settings, loaded, request) -> None:
    """A server and engine of their own that let one program fly at a time (any context fills a billionth of
    memory). The engine is kept busy by a long request of no program: an idle engine would let b through anyway."""
    engine = Engine(replace(settings.engine_config(), in_flight=1e-9), loaded)
    request.addfinalizer(engine.shutdown)
    assert engine.scheduler.gate is engine.flight  # the engine's door is the programs' count
    settings = Settings(engine={"max_num_seqs": 4}, semantic_cache={"enabled": False}, agents={"in_flight": 1e-9})
    closed = {"type": "object", "properties": {}, "additionalProperties": False}  # a short call: no arguments
    forced = {"tools": [{"type": "function", "function": {"name": "search", "parameters": closed}}]}
    forced |= {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 48}

    with serving(settings, engine) as base:
        first = [{"role": "user", "content": TASK}]
        one = turn(base, first, "flight-a", key="flight-key", **forced).parse()
        assert one.choices[0].finish_reason == "tool_calls"  # a is waiting on its tool: still in flight
        with ThreadPoolExecutor(2) as pool:
            stop = threading.Event()
            busy = pool.submit(busy_until, stop, base, "flight-key")
            wait_until(lambda: engine.scheduler.running, 30, "the long request never ran")
            other = pool.submit(turn, base, [{"role": "user", "content": "List the files."}], "flight-b", "flight-key")
            wait_until(lambda: len(engine.scheduler.held) == 1, 30, "b's first turn was not held at the door")
            metrics = loopback.get(f"{base}/metrics", timeout=10).text
            assert "kvgate_programs_in_flight 1" in metrics and "kvgate_programs_in_flight_limit 1" in metrics
            time.sleep(1.0)
            assert not other.done()
            messages = after_tool_call(first, "", "config.py")
            last = turn(base, messages, "flight-a", key="flight-key", tool_choice="none").parse()
            assert last.choices[0].finish_reason in ("stop", "length")  # a answered: its program ended
            assert other.result(timeout=120).parse().choices[0].message.content is not None
            assert not busy.done()  # b went when a landed, not when the engine ran out of work
            stop.set()
            assert busy.result(timeout=60) < 512
