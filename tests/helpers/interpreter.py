"""Triton kernels checked on a CPU: a test module run again as a script under TRITON_INTERPRET=1.

Triton's interpreter is chosen when @triton.jit runs, i.e. when kvgate.runtime.kernels is imported, and only if
TRITON_INTERPRET=1 is set by then; other test modules may have imported it already, so the checks run in a process
of their own. The script prints its failures as JSON, a list per check, on its last line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[2]


def interpreted(script: str) -> dict[str, list[str]]:
    """The failures of each check of `script` (a test module's __file__), run under the interpreter."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton, or the 'test' extra)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])
