"""The semantic cache's error bound through the gateway, with the shipped categories: the same question
is served at once, a paraphrase only once verdicts allow it, every answer the model gives near an entry
is a verdict, and a caller reports a wrong hit by its completion id (the openai SDK and kvgate.Client
against a real server and the real model)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

import kvgate
from kvgate.gateway.backend import Call
from kvgate.gateway.semantic import Checks
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.semantic_cache.config import DEFAULT_CATEGORIES
from tests.helpers import loopback
from tests.helpers.servers import serving
from tests.helpers.waiting import wait_until

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def url(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("feedback") / "semantic.sqlite3"
    settings = Settings(
        engine={"max_num_seqs": 4}, semantic_cache={"path": path}, security={"api_keys": KEYS, "admin_key": ADMIN}
    )
    with serving(settings, engine) as base:
        yield base


def ask(url: str, question: str, key: str = "key-alice"):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    return client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0
    )


def bound(url: str) -> dict:
    stats = loopback.get(f"{url}/admin/semantic-cache", headers={"authorization": f"Bearer {ADMIN}"}).json()
    return stats["bound"]


def test_the_same_question_hits_and_a_paraphrase_is_answered_by_the_model_and_judged(url: str) -> None:
    stamp = time.monotonic_ns()
    question = f"Why do people enjoy long walks in the park {stamp}?"
    assert ask(url, question).headers["x-kvgate-cache"] == "miss"
    same = ask(url, question.upper())
    assert same.headers["x-kvgate-cache"] == "hit" and float(same.headers["x-kvgate-cache-score"]) == 1.0
    before = sum(bound(url)["verdicts"].values())
    near = ask(url, f"Why do people like taking long walks in parks {stamp}?")
    assert near.headers["x-kvgate-cache"] == "miss"  # a new cache has no verdicts: not yet
    assert sum(bound(url)["verdicts"].values()) == before + 1  # the model's answer judged the entry


def test_a_wrong_hit_reported_by_its_id_is_deleted_and_taught(url: str) -> None:
    question = f"What colour is the sky on Mars {time.monotonic_ns()}?"
    ask(url, question)
    hit = ask(url, question)
    assert hit.headers["x-kvgate-cache"] == "hit"
    completion = hit.parse().id
    with kvgate.Client(url, api_key="key-bob") as bob, pytest.raises(kvgate.NotFoundError):
        bob.report_wrong_hit(completion)  # only the tenant served may report it
    wrong = bound(url)["verdicts"]["wrong"]
    with kvgate.Client(url, api_key="key-alice") as alice:
        assert alice.report_wrong_hit(completion) == hit.headers["x-kvgate-cache-entry"]
        with pytest.raises(kvgate.NotFoundError):
            alice.report_wrong_hit(completion)  # once
    assert bound(url)["verdicts"]["wrong"] == wrong + 1
    assert ask(url, question).headers["x-kvgate-cache"] == "miss"


def test_a_bad_feedback_body_is_a_400_in_the_openai_format(url: str) -> None:
    headers = {"authorization": "Bearer key-alice"}
    for body in ({}, {"id": ""}, {"id": 7}):
        reply = loopback.post(f"{url}/v1/cache/feedback", json=body, headers=headers)
        assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("id"), body
    assert loopback.post(f"{url}/v1/cache/feedback", json={"id": "x"}).status_code == 401


def test_the_bound_is_in_the_metrics_one_series_per_category(url: str) -> None:
    ask(url, f"Why is the ocean salty {time.monotonic_ns()}?")
    text = loopback.get(f"{url}/metrics").text
    names = [c["name"] for c in yaml.safe_load(DEFAULT_CATEGORIES.read_text())["categories"]]
    for name in names:
        assert f'kvgate_semantic_threshold{{category="{name}"}}' in text
        assert f'kvgate_semantic_verdicts_total{{category="{name}",verdict="wrong"}}' in text
    assert 'kvgate_semantic_max_error_rate{category="code"} 0.0' in text
    assert text.count("kvgate_semantic_threshold{") == len(names)


def test_beside_a_checked_hit_is_served_and_the_model_answers_it_in_the_background(
    engine: Engine, tmp_path: Path
) -> None:
    settings = Settings(
        engine={"max_num_seqs": 4},
        semantic_cache={"path": tmp_path / "semantic.sqlite3", "verify_rate": 1.0, "verify_beside": True},
        security={"admin_key": ADMIN},
    )
    question, paraphrase = "What is the capital of France?", "Which city is the capital of France?"
    client = openai.OpenAI(base_url="http://unused/v1", api_key="k", max_retries=0, timeout=120)
    with serving(settings, engine) as base:
        client = client.with_options(base_url=f"{base}/v1")

        def ask_(text: str):
            return client.chat.completions.with_raw_response.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": text}],
                max_tokens=6,
                temperature=0,
                extra_headers={"cache-control": "no-store"} if text == paraphrase else None,
            )

        ask_(question)
        for _ in range(3):  # the model answers both alike ("The capital of France is Paris"): the entry opens
            assert ask_(paraphrase).headers["x-kvgate-cache"] == "miss"
        served = ask_(paraphrase)
        assert served.headers["x-kvgate-cache"] == "hit" and served.headers["x-kvgate-cache-check"] == "beside"
        checked = lambda: sum(bound(base)["verdicts"][v] for v in ("right", "wrong")) >= 4  # noqa: E731
        wait_until(checked, 60, "the check beside the hit never ran", every_s=0.2)
        checks = loopback.get(f"{base}/admin/semantic-cache", headers={"authorization": f"Bearer {ADMIN}"}).json()
        assert checks["checks"]["checked"] == 1 and checks["checks"]["dropped"] == 0


def test_checks_beside_hits_are_bounded_and_wait_only_so_long_for_an_idle_backend() -> None:
    """A backend that is never idle (a stand-in: real load that lasts a minute is too slow for a test)."""

    class Busy:
        def queued(self) -> int:
            return 1

    async def run() -> dict[str, int]:
        checks = Checks(limit=2, patience_s=0.2)
        call = Call(
            path="/v1/chat/completions", body={"stream": True}, raw=b"{}", model="m", tenant="t", request_id="r"
        )
        for _ in range(3):
            checks.offer(Busy(), None, call, None)  # type: ignore[arg-type]
        assert checks.stats()["waiting"] == 2 and checks.counts["dropped"] == 1  # the third: no room
        await asyncio.gather(*checks.waiting)
        return checks.stats()

    assert asyncio.run(run()) == {"checked": 0, "dropped": 3, "waiting": 0}
