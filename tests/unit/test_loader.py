"""The loader: which dtype a model runs in, and what it reports."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvgate.runtime.config import EngineConfig
from kvgate.runtime.loader import ONEDNN_CACHE_ENTRIES, ONEDNN_CACHES, dtype_of, load, native_bf16

CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(not CPUINFO.is_file(), reason="needs Linux's /proc/cpuinfo")
def test_native_bf16_on_cpu_is_what_the_cpu_flags_say() -> None:
    flags = {word for line in CPUINFO.read_text().splitlines() if line.startswith("flags") for word in line.split()}
    assert native_bf16("cpu") == bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})


def test_auto_is_bf16_only_where_the_device_computes_it_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    # This machine's CPU decides what `auto` is here; torch's own probe is replaced to see the other case.
    expected = torch.bfloat16 if native_bf16("cpu") else torch.float32
    assert dtype_of(EngineConfig()) == expected
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert dtype_of(EngineConfig(dtype="auto")) == torch.bfloat16
    assert dtype_of(EngineConfig(dtype="float32")) == torch.float32  # an explicit dtype is kept
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert dtype_of(EngineConfig(dtype="auto")) == torch.float32
    assert dtype_of(EngineConfig(dtype="bfloat16")) == torch.bfloat16


def test_a_model_loaded_in_bf16_says_so_and_bounds_onednns_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN reads its caches' capacities from the environment before its first bf16 matmul: the loader sets
    them (runtime/loader.py: at oneDNN's 1024 a bf16 server grew towards ~700 MiB), an operator's own value kept."""
    monkeypatch.delenv(ONEDNN_CACHES[0], raising=False)
    monkeypatch.setenv(ONEDNN_CACHES[1], "500")
    loaded = load(EngineConfig(dtype="bfloat16"))
    assert loaded.model.dtype == torch.bfloat16 and loaded.dtype == "bfloat16"
    assert os.environ[ONEDNN_CACHES[0]] == str(ONEDNN_CACHE_ENTRIES) and os.environ[ONEDNN_CACHES[1]] == "500"
