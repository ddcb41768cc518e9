"""One real model per test run, shared by a real uvicorn server on a free loopback port."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest

from kvgate.gateway import settings_flat
from kvgate.gateway.settings import Settings, user_cache_dir
from kvgate.runtime.cpu_attention import machine_key
from tests.helpers import corpus, questions
from tests.helpers.redis_server import RedisServer

if TYPE_CHECKING:  # imported by the fixtures that use them: pytest-xdist's controller, which runs no test,
    # loads this file before it starts the workers, and torch with transformers would hold them back ~10 s
    from kvgate.runtime.engine import Engine
    from kvgate.runtime.loader import LoadedModel

# The slowest test files, slowest first (seconds of `make test`, measured: 139 ... 34), run before the rest in
# collection order: pytest-xdist hands files out in this order (`make test` passes --no-loadscope-reorder; by
# default it orders files by their number of tests, which left the slowest, a few long tests each, to the end,
# and the run then ended on one worker with a minute of work left while the other idled).
SLOWEST_FIRST = (
    "server/test_fuzz.py",
    "server/test_cli.py",
    "server/test_tiers.py",
    "server/test_tools_gateway.py",
    "server/test_semantic_gateway.py",
    "server/test_load.py",
    "abuse/test_workers_abuse.py",
    "server/test_chunks_gateway.py",
    "server/test_responses.py",
    "server/test_responses_items.py",
    "unit/test_blend.py",
    "server/test_tenant_kv.py",
    "abuse/test_caches.py",
    "server/test_agents_gateway.py",
    "unit/test_engine.py",
    "server/test_workers.py",
    "server/test_fleet.py",
    "server/test_gateway.py",
    "unit/test_semantic_redis.py",
    "abuse/test_flood.py",
    "abuse/test_stalls.py",
    "frameworks/test_frameworks_crewai.py",
)
LINKED = ("models", "bench")  # made once, shared: the converted model, the benchmarks' embeddings
COPIED = ("digests",)  # the files' hashes (the model's is seconds of sha256): copied, so never written back


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gone = [name for name in SLOWEST_FIRST if not (Path(__file__).parent / name).is_file()]
    if gone:
        raise pytest.UsageError(f"conftest.SLOWEST_FIRST names files that are gone: {gone}")
    rank = {f"tests/{name}": i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected


@pytest.fixture(scope="session", autouse=True)
def run_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every Settings() of the run, in this process and in the ones it starts (they inherit the environment),
    uses a cache directory of the run's own: what a developer keeps in theirs (a `kvgate calibrate` result
    the engine would serve, a semantic cache, document KV) changes nothing the tests see. Only what is the
    same for everyone is shared: the converted model is linked from theirs (not converted again), and so
    are the benchmarks' embeddings. Under pytest's basetemp: a run killed midway leaves nothing behind
    that pytest does not clear later. The model runs in float32 whatever the CPU (`dtype: auto` would pick
    bf16 on one with AVX512-BF16 or AMX): the suite's expectations are the same on every machine."""
    theirs = Path(os.environ.get("KVGATE_CACHE_DIR") or user_cache_dir())
    ours = tmp_path_factory.mktemp("xdg") / "kvgate"  # the user's cache of the run: where configs built alone land
    ours.mkdir()
    (theirs / "models").mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        if (theirs / name).is_dir():
            (ours / name).symlink_to((theirs / name).resolve(), target_is_directory=True)
    for name in COPIED:
        if (theirs / name).is_dir():
            shutil.copytree(theirs / name, ours / name)
    copy_kernels(user_cache_dir() / "kernels", ours / "kernels")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVGATE_CACHE_DIR", str(ours))
        env.setenv("XDG_CACHE_HOME", str(ours.parent))
        env.setenv("KVGATE_ENGINE__DTYPE", "float32")
        env.setenv("KVGATE_CACHES__SHIPPED_CALIBRATION", "false")  # nor does the calibration kvgate ships
        # With no calibration a server blends only at ratios its shadow checks opened (runtime/quality.py), and
        # these servers check nothing (`settings` below): blends left to them run at an operator's 15%, the
        # ratio of an uncalibrated engine before, as the tests of what a blend does expect. A server's own
        # choice is tested on servers that set it back (tests/server/test_calibrating.py, unit/test_calibration.py).
        env.setenv("KVGATE_CACHES__RECOMPUTE_RATIO", "0.15")
        yield ours


def copy_kernels(theirs: Path, ours: Path) -> None:
    """The C kernels the developer's cache holds for these sources on this machine (runtime/cpu_attention.py),
    copied into the run's: seconds of compiling saved, and a copy (never a link: the kernels load only from a
    directory of this user's own)."""
    ours.mkdir(mode=0o700)
    try:
        key = machine_key()
    except OSError:
        return
    for built in theirs.glob(f"cpu_attention-{key}-*.so"):
        shutil.copy2(built, ours / built.name)


@pytest.fixture(scope="session", autouse=True)
def grouped_names() -> Iterator[None]:
    """The suite spells settings by their groups: only tests/unit/test_settings.py uses the flat names of before
    (a developer's own KVGATE_* variables aside)."""
    yield
    flat = sorted(name for name in settings_flat.noticed if not name.startswith("KVGATE_"))
    assert not flat, f"settings spelled by their flat names of before: {flat}"


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the generated evaluation text is written, once per run (tests/helpers/corpus.py)."""
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
    # Document KV on disk starts empty each run; the cache directory is the run's own (run_cache).
    # The semantic cache is off here: these tests send the same temperature-0 requests again and
    # compare what the model does; tests/server/test_semantic_gateway.py runs servers with it on.
    # Prefix caching and content-defined chunks are off here too: these tests count the reuse of what they
    # are about (documents, programs, spans) and compare first turns with nothing reused;
    # tests/*/test_prefix*.py, test_chunks*.py, server/test_documents.py and server/test_tenant_kv.py run a server
    # with both on (`prefix_engine`), as every server has them by default.
    # The quality gate checks nothing on these shared servers: what it withholds would depend on the tests
    # run before (an agent's first requests are all checked); it is tested on engines of its own
    # (unit/test_quality.py, unit/test_shadow.py, unit/test_fidelity.py).
    chunks = tmp_path_factory.mktemp("chunks")
    caches = {"dir": chunks, "prefix_caching": False, "content_chunks": False}
    off = {"semantic_cache": {"enabled": False}, "quality": {"shadow_rate": 0.0}}
    return Settings(engine={"max_num_seqs": 8}, caches=caches, **off)


@pytest.fixture(scope="session")
def loaded(settings: Settings) -> LoadedModel:
    from kvgate.runtime.loader import load

    return load(settings.engine_config())


@pytest.fixture(scope="session")
def engine(settings: Settings, loaded: LoadedModel) -> Iterator[Engine]:
    from kvgate.runtime.engine import Engine

    engine = Engine(settings.engine_config(), loaded)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def base_url(settings: Settings, engine: Engine) -> Iterator[str]:
    from tests.helpers.servers import serving

    with serving(settings, engine) as url:
        yield url


@pytest.fixture(scope="session")
def prefix_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"caches": {"prefix_caching": True, "content_chunks": True}})


@pytest.fixture(scope="session")
def prefix_engine(prefix_settings: Settings, loaded: LoadedModel) -> Iterator[Engine]:
    """An engine with automatic prefix caching and content-defined chunks, as every server has by default."""
    from kvgate.runtime.engine import Engine

    engine = Engine(prefix_settings.engine_config(), loaded)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def prefix_base_url(prefix_settings: Settings, prefix_engine: Engine) -> Iterator[str]:
    from tests.helpers.servers import serving

    with serving(prefix_settings, prefix_engine) as url:
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
def grid(engine: Engine) -> int:
    """Where the server's prefix reads end: a multiple of 64, or any token where its CPU kernel attends every
    layer (runtime/model.py grid_of)."""
    return engine.scheduler.grid


@pytest.fixture(scope="session")
def chat_ids(loaded: LoadedModel):
    from kvgate.runtime.tokens import chat_prompt

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
