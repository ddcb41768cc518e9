"""kvgate in front of a fleet: two kvgate runtimes configured as plain upstreams (the path vLLM and SGLang
replicas take) behind two fronts on one real Redis. Every turn of a conversation lands on the replica
holding its KV, whichever front it reaches; conversations spread over the replicas; a conversation whose
replica stops moves to another and stays there, and one whose replica is busy with requests from
elsewhere (as its /metrics says) spills; a response continues through either front, and an agent's
loop its program through either server."""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from threading import Thread

import httpx
import openai
import pytest

from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel
from tests.helpers import loopback
from tests.helpers.dashboards import FLEET, load, samples, unmatched
from tests.helpers.servers import serving
from tests.helpers.waiting import wait_until

# A system prompt long enough that prefix blocks (64 tokens) hold most of a first turn's prompt.
SYSTEM = "You are the booking assistant of a travel agency. " + " ".join(
    f"Rule {n}: confirm the traveller's dates, budget and seat preference before booking trip {n}." for n in range(14)
)


@contextmanager
def replicas(loaded: LoadedModel, where: Path, count: int = 2, **more) -> Iterator[list[str]]:
    """`count` kvgate runtimes on loopback, each with its own engine and caches (and `more` settings)."""
    with ExitStack() as stack:
        urls = []
        for i in range(count):
            settings = Settings(
                engine={"max_num_seqs": 4},
                semantic_cache={"enabled": False},
                cache_dir=where / f"r{i}",
                caches={"disk_bytes": 0},
                **more,
            )
            engine = Engine(settings.engine_config(), loaded)
            stack.callback(engine.shutdown)
            urls.append(stack.enter_context(serving(settings, engine)))
        yield urls


def fronted(urls: list[str], model: str, redis_url: str, where: Path, **more) -> Settings:
    upstreams = [{"name": f"replica-{i}", "base_url": url + "/v1", "models": [model]} for i, url in enumerate(urls)]
    settings = Settings(proxy={"upstreams": upstreams}, redis_url=redis_url, semantic_cache={"enabled": False})
    return settings.model_copy(update={"cache_dir": where, **more})


@pytest.fixture(scope="module")
def whole_fleet(
    loaded: LoadedModel, model_name: str, redis_server, tmp_path_factory
) -> Iterator[tuple[tuple[str, str], list[str]]]:
    """Two fronts over two replicas, on one Redis: the fronts' URLs, and the replicas'."""
    where = tmp_path_factory.mktemp("fleet")
    with replicas(loaded, where) as urls:
        settings = fronted(urls, model_name, redis_server.url, where / "front")
        with serving(settings, None) as one, serving(settings, None) as two:
            yield (one, two), urls


@pytest.fixture(scope="module")
def fleet(whole_fleet) -> tuple[str, str]:
    return whole_fleet[0]


BOOK = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


TOKEN = {"authorization": "Bearer tok"}


def chat(front: str, model: str, messages: list[dict]) -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0}
    r = loopback.post(front + "/v1/chat/completions", json=body, headers=TOKEN, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_every_turn_lands_where_its_kv_is_from_either_front(fleet, model_name):
    """First turns through both fronts in turn, second turns through the other front in the reverse order:
    a front that kept placements of its own would place them anew (and differently)."""
    fronts, firsts = list(fleet), []
    for n in range(6):
        asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Book trip {n} to Lisbon."}]
        firsts.append((asked, chat(fronts[n % 2], model_name, asked)))
    for n, (asked, first) in reversed(list(enumerate(firsts))):
        answer = first.json()["choices"][0]["message"]["content"]
        history = [*asked, {"role": "assistant", "content": answer}, {"role": "user", "content": "And back?"}]
        second = chat(fronts[(n + 1) % 2], model_name, history)  # the other front
        assert second.headers["x-kvgate-upstream"] == first.headers["x-kvgate-upstream"]
        reused = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused >= 0.8 * first.json()["usage"]["prompt_tokens"]
    homes = Counter(first.headers["x-kvgate-upstream"] for _, first in firsts)
    assert homes == {"replica-0": 3, "replica-1": 3}  # spread: none above its share plus one


def test_a_response_continues_through_either_front_on_its_replica(fleet, model_name):
    one, two = (openai.OpenAI(base_url=f + "/v1", api_key="tok") for f in fleet)
    asked = {"model": model_name, "instructions": SYSTEM, "max_output_tokens": 8, "temperature": 0}
    raw = one.responses.with_raw_response.create(**asked, input="Book a trip to Oslo.")
    first = raw.parse()
    again = two.responses.with_raw_response.create(**asked, input="And back?", previous_response_id=first.id)
    assert again.headers["x-kvgate-upstream"] == raw.headers["x-kvgate-upstream"]
    assert again.parse().usage.input_tokens_details.cached_tokens >= 0.8 * first.usage.input_tokens


def test_a_conversation_whose_replica_stops_moves_and_stays(loaded, model_name, redis_url, tmp_path):
    asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Book a trip to Bergen."}]
    with replicas(loaded, tmp_path / "kept", 1) as (kept,), ExitStack() as doomed:
        (gone,) = doomed.enter_context(replicas(loaded, tmp_path / "gone", 1))
        with serving(fronted([gone, kept], model_name, redis_url, tmp_path / "front"), None) as front:
            first = chat(front, model_name, asked)
            assert first.headers["x-kvgate-upstream"] == "replica-0"
            doomed.close()  # replica-0 stops
            history = [*asked, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
            history.append({"role": "user", "content": "And back?"})
            assert chat(front, model_name, history).headers["x-kvgate-upstream"] == "replica-1"
            history += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
            assert chat(front, model_name, history).headers["x-kvgate-upstream"] == "replica-1"


def drain(response: httpx.Response) -> None:
    """Read a stream as a client does, until the test closes it."""
    with contextlib.suppress(httpx.HTTPError, RuntimeError):
        deque(response.iter_bytes(), maxlen=0)


def running(replica: str) -> float:
    text = loopback.get(replica + "/metrics", timeout=10).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("kvgate_requests_running ")))


def test_a_replica_busy_with_another_fronts_requests_spills_a_conversation(loaded, model_name, redis_url, tmp_path):
    """This front sent the busy replica nothing but turn 1; the load is another client's, sent to the replica
    directly: only the replica's own metrics tell the front."""
    asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Book a trip to Turku."}]
    with replicas(loaded, tmp_path / "r") as urls:
        settings = fronted(
            urls, model_name, redis_url, tmp_path / "front", proxy={"spill_at": 2, "replica_load_poll_s": 0.2}
        )
        with serving(settings, None) as front, httpx.Client(timeout=120) as direct:
            first = chat(front, model_name, asked)
            home = first.headers["x-kvgate-upstream"]
            busy = urls[int(home[-1])]
            body = {"model": model_name, "messages": asked, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            streams = [direct.stream("POST", busy + "/v1/chat/completions", json=body) for _ in range(2)]
            opened = [s.__enter__() for s in streams]
            for reader in opened:
                Thread(target=drain, args=(reader,), daemon=True).start()
            try:
                wait_until(lambda: running(busy) >= 2, 60, "the other client's requests running on the replica")
                time.sleep(1.0)  # five of the front's polls
                history = [*asked, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
                history.append({"role": "user", "content": "And back?"})
                assert chat(front, model_name, history).headers["x-kvgate-upstream"] != home
            finally:
                for stream in streams:
                    stream.__exit__(None, None, None)


def test_an_agents_next_turn_continues_its_program_through_another_server(loaded, model_name, redis_url, tmp_path):
    """Two kvgate servers with engines of their own on one Redis, a framework's tool loop with no program id:
    the tool result's turn, sent to the other server, continues the program the first turn began."""
    tools = [{"type": "function", "function": {"name": "book", "parameters": BOOK}}]
    asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Book a trip to Tromso."}]
    with replicas(loaded, tmp_path, 2, redis_url=redis_url) as urls:
        one, two = (openai.OpenAI(base_url=url + "/v1", api_key="tok") for url in urls)
        common = {"model": model_name, "tools": tools, "temperature": 0}
        raw = one.chat.completions.with_raw_response.create(
            messages=asked, tool_choice="required", max_tokens=40, **common
        )
        call = raw.parse().choices[0].message
        result = {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "Booked."}
        messages = [*asked, call.model_dump(exclude_none=True), result]
        again = two.chat.completions.with_raw_response.create(messages=messages, max_tokens=4, **common)
        assert again.headers["x-kvgate-program-id"] == raw.headers["x-kvgate-program-id"]


def test_every_panel_of_the_fleet_dashboard_has_data(whole_fleet, model_name):
    """deploy/grafana/kvgate-fleet.json against what Prometheus would hold of the fronts and the replicas after a
    conversation's two turns, one through each front (the second streamed), and a request for a model no replica
    serves: each selector of each panel matches a sample of one of their /metrics."""
    (one, two), urls = whole_fleet
    asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Book a trip to Riga."}]
    first = chat(one, model_name, asked).json()["choices"][0]["message"]["content"]
    history = [*asked, {"role": "assistant", "content": first}, {"role": "user", "content": "And back?"}]
    body = {"model": model_name, "messages": history, "max_tokens": 6, "temperature": 0, "stream": True}
    with loopback.stream("POST", two + "/v1/chat/completions", json=body, headers=TOKEN, timeout=120) as r:
        assert r.status_code == 200 and b"[DONE]" in r.read()
    nobody = {"model": "nobody", "messages": asked}
    assert loopback.post(one + "/v1/chat/completions", json=nobody, headers=TOKEN).status_code == 404
    scraped = samples(*(loopback.get(url + "/metrics").text for url in (one, two, *urls)))
    missing = unmatched(load(FLEET), scraped)
    assert not missing, "no sample for:\n" + "\n".join(missing)
