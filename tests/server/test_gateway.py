"""gateway/: the official OpenAI SDK against a real uvicorn server on loopback."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from kvgate.runtime.engine import Engine
from kvgate.runtime.sampling import SamplingParams
from tests.conftest import QUESTIONS
from tests.helpers import loopback
from tests.helpers.servers import serving
from tests.helpers.waiting import wait_until


def ask(client: openai.OpenAI, model: str, question: str, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], temperature=0, **kw
    )


def test_chat_completion_equals_engine_greedy(client, model_name, engine: Engine, chat_ids) -> None:
    r = ask(client, model_name, QUESTIONS[0], max_tokens=24)
    ref = engine.generate_sync(chat_ids(QUESTIONS[0]), SamplingParams(max_tokens=24, temperature=0))
    assert r.object == "chat.completion" and r.model == model_name
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(chat_ids(QUESTIONS[0]))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_joins_to_the_same_text(client, model_name) -> None:
    whole = ask(client, model_name, QUESTIONS[2], max_tokens=24)
    chunks = list(
        ask(client, model_name, QUESTIONS[2], max_tokens=24, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_format(base_url, model_name) -> None:
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    with loopback.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"]
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)


def test_chat_logprobs(client, model_name) -> None:
    r = ask(client, model_name, QUESTIONS[1], max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob  # greedy: chosen is best


def test_n_choices_with_seed(client, model_name, chat_ids) -> None:
    kw = dict(
        model=model_name,
        messages=[{"role": "user", "content": QUESTIONS[2]}],
        max_tokens=12,
        temperature=1.0,
        n=3,
        seed=11,
    )
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    assert a.usage.prompt_tokens == len(chat_ids(QUESTIONS[2]))  # one prompt, counted once
    lengths = [c.finish_reason == "length" for c in a.choices]
    assert a.usage.completion_tokens <= 36 and (a.usage.completion_tokens == 36) == all(lengths)


def test_text_completions(client, model_name) -> None:
    r = client.completions.create(
        model=model_name, prompt=["Once upon a time", "The sky is"], max_tokens=5, temperature=0, logprobs=2
    )
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert "".join(c.logprobs.tokens) == c.text
        assert c.logprobs.text_offset[0] == 0 and len(c.logprobs.top_logprobs[0]) == 2
    echoed = client.completions.create(model=model_name, prompt="The sky is", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "The sky is" + r.choices[1].text
    streamed = client.completions.create(
        model=model_name, prompt="The sky is", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[1].text


def test_token_id_prompt_equals_text_prompt(client, model_name, loaded) -> None:
    ids = loaded.tokenizer.encode("The capital of Spain is")
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=model_name, prompt="The capital of Spain is", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_eight_concurrent_requests_equal_serial(client, model_name) -> None:
    serial = [ask(client, model_name, q, max_tokens=12).choices[0].message.content for q in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda q: ask(client, model_name, q, max_tokens=12).choices[0].message.content, QUESTIONS)
        )
    assert together == serial


def test_models_health_and_request_id(base_url, client, model_name) -> None:
    # The LLM first, then the embedding model /v1/embeddings serves.
    assert [m.id for m in client.models.list().data] == [model_name, "all-MiniLM-L6-v2"]
    assert client.models.retrieve(model_name).id == model_name
    health = loopback.get(f"{base_url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert len(health.headers["x-request-id"]) == 32
    mine = loopback.get(f"{base_url}/v1/models", headers={"x-request-id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    r = loopback.post(
        f"{base_url}/v1/chat/completions",
        headers={"x-request-id": "trace-43"},
        json={"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    assert r.json()["id"] == "chatcmpl-trace-43"


def test_unknown_fields_are_ignored(base_url, model_name) -> None:
    r = loopback.post(
        f"{base_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": model_name,
            "messages": [{"role": "user", "content": "Hi", "mood": "happy"}],
            "max_tokens": 2,
            "some_future_field": {"x": 1},
            "parallel_tool_calls": True,
        },
    )
    assert r.status_code == 200, r.text


def test_text_parts_and_system_roles(client, model_name) -> None:
    parts = client.chat.completions.create(
        model=model_name,
        max_tokens=8,
        temperature=0,
        messages=[
            {"role": "developer", "content": "You answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]},
        ],
    )
    plain = client.chat.completions.create(
        model=model_name,
        max_tokens=8,
        temperature=0,
        messages=[
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_client_hanging_up_mid_stream_frees_the_engine(base_url, model_name, engine: Engine) -> None:
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with loopback.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break
    wait_until(lambda: not engine.load_stats["running"], 15, "the engine kept decoding for a client that left")


def test_tokenizing_a_huge_prompt_does_not_stall_other_clients(base_url, model_name) -> None:
    # About 3 MB of prompt: seconds of template rendering and tokenizing, then a context-window 400.
    huge = {"model": model_name, "messages": [{"role": "user", "content": "word " * 600_000}], "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        big = pool.submit(httpx.post, f"{base_url}/v1/chat/completions", json=huge, timeout=120)
        waits = []
        while not big.done():
            t = time.monotonic()
            assert loopback.get(f"{base_url}/health", timeout=60).status_code == 200
            waits.append(time.monotonic() - t)
        took = time.monotonic() - started
    assert big.result().status_code == 400
    assert len(waits) > 5 and max(waits) < took / 3, (max(waits), took)


def test_null_means_the_default(base_url, model_name) -> None:
    nulls = dict.fromkeys(["n", "stream", "presence_penalty", "frequency_penalty", "temperature", "seed", "stop"])
    chat = loopback.post(
        f"{base_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": model_name,
            "messages": [{"role": "user", "content": "Hi", "name": None}],
            "max_tokens": 2,
            **nulls,
            **dict.fromkeys(["logprobs", "top_logprobs", "ignore_eos", "add_generation_prompt", "stream_options"]),
        },
    )
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 2, **nulls, "echo": None, "logprobs": None}
    text = loopback.post(f"{base_url}/v1/completions", timeout=60, json=body)
    assert text.status_code == 200, text.text
    body |= {"stream": True, "stream_options": {"include_usage": None}}
    with loopback.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and all("usage" not in e for e in events)


def test_streamed_text_offsets_count_tokens_held_back_for_a_stop_string(client, model_name) -> None:
    kw = dict(model=model_name, prompt="The sky is", max_tokens=12, temperature=0, logprobs=1, stop=["zzzzzzzzzz"])
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
    assert offsets == [len("".join(whole.logprobs.tokens[:i])) for i in range(len(offsets))]
    assert "".join(c.text for c in chunks) == whole.text


def test_logprobs_zero_gives_the_sampled_token(client, model_name) -> None:
    r = client.completions.create(model=model_name, prompt="The sky is", max_tokens=4, temperature=1.0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs == [{t: p} for t, p in zip(lp.tokens, lp.token_logprobs)]


def test_a_stopped_gateway_leaves_no_thread_of_its_own(settings, engine) -> None:
    """The local backend's pin-expiry thread ends with the server (the engine's is the fixture's)."""

    def expiry_threads() -> int:
        return sum(t.name == "kvgate-pin-expiry" and t.is_alive() for t in threading.enumerate())

    before = expiry_threads()
    with serving(settings, engine) as url:
        assert loopback.get(f"{url}/health").status_code == 200
        assert expiry_threads() == before + 1
    assert expiry_threads() == before
