"""What users install: a wheel holding `kvgate` alone, and `kvgate` beside the OpenAI Agents SDK.

The repository's agents/ folder installs as `kvgate.agents`; the name `agents` belongs to the SDK.
From the repository root `import agents` finds the folder, so the SDK side runs in a subprocess
started elsewhere, without the repository on sys.path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_kvgate_and_nothing_else(tmp_path: Path) -> None:
    # setuptools builds in place: build/ and kvgate.egg-info/ would land in the repository. An extra
    # distutils config (DIST_EXTRA_CONFIG) sends both to tmp_path, so the build leaves no trace.
    config = tmp_path / "setup.cfg"
    config.write_text(f"[build]\nbuild_base = {tmp_path / 'build'}\n[egg_info]\negg_base = {tmp_path}\n")
    env = {**os.environ, "DIST_EXTRA_CONFIG": str(config), "PIP_NO_INPUT": "1"}
    before = {p.name for p in ROOT.iterdir()}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir"]
        + ["--wheel-dir", str(tmp_path / "dist"), str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("kvgate-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        tops = {n.split("/")[0] for n in names}
        assert tops == {"kvgate", info}, f"the wheel installs more than kvgate: {sorted(tops)}"
        assert info.startswith("kvgate-")
        # The package-dir mapping shipped every folder under kvgate/, data included.
        for name in [
            "kvgate/__init__.py",
            "kvgate/gateway/app.py",
            "kvgate/gateway/cli.py",
            "kvgate/runtime/engine.py",
            "kvgate/chunk_cache/store.py",
            "kvgate/semantic_cache/cache.py",
            "kvgate/semantic_cache/categories.yaml",
            "kvgate/agents/anchors.py",
            "kvgate/bench/ttft.py",
        ]:
            assert name in names, f"{name} is not in the wheel"
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        assert "kvgate = kvgate.gateway.cli:main" in entry_points
    assert (tmp_path / "build" / "lib" / "kvgate").is_dir()
    left = {p.name for p in ROOT.iterdir()} - before
    assert not left & {"build", "dist", "kvgate.egg-info"}, f"the build left {sorted(left)} in the repository"


# Runs with the venv's python in a temporary folder, isolated (-I): no cwd, no PYTHONPATH on sys.path.
SDK_RUN = """
import json, os, sys

root = os.environ["KVGATE_REPO"]
assert root not in sys.path and "" not in sys.path, sys.path

import agents
import kvgate
import kvgate.agents
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)
model = OpenAIChatCompletionsModel(
    model=os.environ["KVGATE_MODEL"],
    openai_client=AsyncOpenAI(base_url=os.environ["KVGATE_URL"] + "/v1", api_key="unused", max_retries=0, timeout=120),
)
agent = Agent(
    name="assistant",
    instructions="You answer in one short sentence.",
    model=model,
    model_settings=ModelSettings(max_tokens=8, temperature=0),
)
result = Runner.run_sync(agent, "What is the capital of France?", max_turns=1)
print(json.dumps({
    "agents": agents.__file__,
    "kvgate": kvgate.__file__,
    "kvgate.agents": kvgate.agents.__file__,
    "final_output": result.final_output,
}))
"""


def test_the_agents_sdk_runs_a_turn_against_kvgate_in_the_same_environment(
    base_url: str, model_name: str, tmp_path: Path
) -> None:
    try:
        metadata.version("openai-agents")
    except metadata.PackageNotFoundError:
        pytest.fail("openai-agents is not installed: it belongs in the test extra of pyproject.toml")
    env = {
        **os.environ,
        "KVGATE_URL": base_url,
        "KVGATE_MODEL": model_name,
        "KVGATE_REPO": str(ROOT),
        "OPENAI_AGENTS_DISABLE_TRACING": "1",  # nothing but loopback can be reached
    }
    done = subprocess.run(
        [sys.executable, "-I", "-c", SDK_RUN], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # The SDK from site-packages, kvgate from the repository (an editable install).
    assert Path(seen["agents"]).parent.parent.name == "site-packages", seen
    assert Path(seen["kvgate.agents"]) == ROOT / "agents" / "__init__.py", seen
    assert Path(seen["kvgate"]) == ROOT / "kvgate" / "__init__.py", seen
    assert isinstance(seen["final_output"], str) and seen["final_output"].strip(), seen
