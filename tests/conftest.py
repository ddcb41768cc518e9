"""One real model per test run, shared by a real uvicorn server on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvgate.gateway.settings import Settings, user_cache_dir
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.tokens import chat_prompt
from tests import corpus, questions
from tests.redis_server import RedisServer
from tests.servers import serving


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the generated evaluation text is written, once per run (tests/corpus.py)."""
    return tmp_path_factory.mktemp("corpus")


@pytest.fixture(scope="session")
def musique(corpus_dir: Path) -> Path:
    """MuSiQue-like RAG items (question, answers, 10 passages), for `--data` of the MuSiQue benchmarks."""
    return corpus.write_jsonl(corpus_dir / "musique.jsonl", corpus.musique_rows(8))


@pytest.fixture(scope="session")
def gsm8k(corpus_dir: Path) -> Path:
    """GSM8K-like word problems (question, answer), for `--data` of `kvgate bench multiagent`."""
    return corpus.write_jsonl(corpus_dir / "gsm8k.jsonl", questions.gsm8k_rows(8))


@pytest.fixture(scope="session")
def qqp(corpus_dir: Path) -> Path:
    """QQP-like question pairs (a, b, duplicate), for `--data` of the semantic benchmarks."""
    return corpus.write_jsonl(corpus_dir / "qqp.jsonl", questions.qqp_rows(400))


@pytest.fixture(scope="session")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    # Document KV on disk starts empty each run; the converted model stays in the user cache.
    # The semantic cache is off here: these tests send the same temperature-0 requests again and
    # compare what the model does; tests/test_semantic_gateway.py runs servers with it on.
    # A cache directory of the run's own, so that what a developer stored in the user cache (a
    # `kvgate calibrate` result: the engine would serve its ratio) changes nothing here; the converted
    # model is linked from the user cache, not converted again.
    cache, models = tmp_path_factory.mktemp("cache"), user_cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(models)
    chunks = tmp_path_factory.mktemp("chunks")
    return Settings(cache_dir=cache, max_num_seqs=8, chunk_cache_dir=chunks, semantic_cache=False)


@pytest.fixture(scope="session")
def loaded(settings: Settings) -> LoadedModel:
    return load(settings.engine_config())


@pytest.fixture(scope="session")
def engine(settings: Settings, loaded: LoadedModel) -> Iterator[Engine]:
    engine = Engine(settings.engine_config(), loaded)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def base_url(settings: Settings, engine: Engine) -> Iterator[str]:
    with serving(settings, engine) as url:
        yield url


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server for a test module."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The module's redis-server, emptied for each test."""
    with redis_server.client() as raw:
        raw.flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(engine: Engine) -> str:
    return engine.loaded.name


@pytest.fixture(scope="session")
def chat_ids(loaded: LoadedModel):
    def render(question: str) -> list[int]:
        return chat_prompt(loaded.tokenizer, [{"role": "user", "content": question}])

    return render


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How do birds fly?",
    "What is Python used for?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
    "Give me a tip for sleeping well.",
]
