"""One real model per test run, shared by a real uvicorn server on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import uvicorn

from gateway.app import create_app
from gateway.settings import Settings
from runtime.engine import Engine
from runtime.loader import LoadedModel, load
from runtime.tokens import chat_prompt

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings(max_num_seqs=8)


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
    port = free_port()
    config = uvicorn.Config(create_app(settings, engine), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


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
