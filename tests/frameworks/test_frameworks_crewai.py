"""CrewAI's sequential crew against kvgate's default server, with no kvgate field: the writer's task gets the
researcher's notes pasted inside its own user message, under another system prompt, and kvgate finds them by
their content (chunks kept from the researcher's answer).

CrewAI 1.15 needs the openai SDK below 3 and kvgate's test extras pin 3, so CrewAI runs from a virtualenv of its
own (`make .venv-crewai`, which `make test` builds), as a subprocess started outside the repository's import
path."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CREWAI_PYTHON = ROOT / ".venv-crewai" / "bin" / "python"
QUIET = {"CREWAI_DISABLE_TELEMETRY": "true", "CREWAI_TRACING_ENABLED": "false", "OTEL_SDK_DISABLED": "true"}


def kickoff(base_url: str, model: str, topic: str, home: Path) -> dict:
    if not CREWAI_PYTHON.exists():
        pytest.skip("CrewAI's virtualenv is not built (make .venv-crewai)")
    script = ROOT / "tests" / "helpers" / "crewai_crew.py"
    env = {**os.environ, **QUIET, "HOME": str(home)}
    # -P: the script's folder (tests/) is not put on the import path, where its modules could shadow CrewAI's
    done = subprocess.run(
        [str(CREWAI_PYTHON), "-P", str(script), base_url, model, topic],
        cwd=home, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_sequential_crew_reuses_the_researchers_notes_in_the_writers_prompt(
    prefix_base_url: str, model_name: str, tmp_path: Path
) -> None:
    crew = kickoff(prefix_base_url, model_name, "windmills", tmp_path)
    research, write = crew["calls"]
    assert all(call["status"] == 200 for call in crew["calls"]), crew["calls"]
    notes = crew["notes"].strip().strip('"')
    pasted = write["messages"][-1]["content"]
    assert write["messages"][0]["content"] != research["messages"][0]["content"]  # the writer's own system prompt
    assert notes[:200] in pasted  # CrewAI pasted the notes inside the writer's user message

    # The notes are the researcher's answer: its completion tokens, all repeated in the writer's prompt.
    repeated = research["usage"]["completion_tokens"]
    assert "chunks found by content" in (write["reuse"] or ""), write
    assert write["usage"]["prompt_tokens_details"]["cached_tokens"] == write["reused"]
    assert write["reused"] >= 0.8 * repeated, (write["reused"], repeated, write["reuse"])
    print(write["reused"], repeated, write["reuse"], crew["usage"])
    # and what a CrewAI user reads: the crew's own count of cached prompt tokens
    assert crew["usage"]["cached_prompt_tokens"] >= write["reused"]
