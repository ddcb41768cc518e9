"""README.md's commands, as written: every `kvgate ...` line of its code blocks and every inline
`kvgate ...` span parses with the real parser (`kvgate.gateway.cli.parse`, which `main` uses, stopping
there), and `kvgate serve --config gateway.yaml` really serves in proxy mode.

How the README's notation is read:
- `[...]` is optional: each command is parsed twice, without its optional groups and with all of them
  (brackets dropped);
- an upper-case word (`H`, `P`, `PATH`, `NAME`, `N`) is a placeholder: it is replaced by the example
  value in EXAMPLES before parsing (a new placeholder fails the test until it is given one);
- a span ending in `...` (`kvgate bench ...`) names a family of commands, not one: it is not parsed,
  but some parsed command must start with it;
- `# ...` ends a line (a comment), `.venv/bin/kvgate` is `kvgate`, and `make serve` (Set up) counts
  as the `kvgate` lines its Makefile recipe runs.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvgate.bench.upstream import serve_upstream
from kvgate.gateway import cli
from tests.helpers import loopback
from tests.helpers.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
KVGATE = str(Path(sys.executable).parent / "kvgate")  # the installed console script
EXAMPLES = {
    "H": "0.0.0.0",
    "P": "8080",
    "PATH": "/path/to/model",
    "NAME": "my-model",
    "N": "3",
    "FILE": "g.yaml",
    "DIR": "/tmp",
}
EXECUTABLE = r"(?:\.venv/bin/|\$\(BIN\)/)?kvgate"  # kvgate, .venv/bin/kvgate, $(BIN)/kvgate (Makefile)
PROGRAM = re.compile(rf"^{EXECUTABLE}\s+\S")  # a line that runs it with a command


def code_lines() -> list[str]:
    """The `kvgate` lines of the README's fenced code blocks."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", README, re.S | re.M)
    return [line.strip() for block in blocks for line in block.splitlines() if PROGRAM.match(line.strip())]


def inline_spans() -> list[str]:
    """The README's inline code spans that are `kvgate` commands (not `x-kvgate-...` or `kvgate[lmcache]`)."""
    return [span.strip() for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", README) if PROGRAM.match(span.strip())]


def makefile_lines(target: str) -> list[str]:
    """The `kvgate` lines of a Makefile target's recipe (what `make serve` runs)."""
    recipe = re.search(rf"^{target}:[^\n]*\n((?:\t[^\n]*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, f"Makefile has no {target} target"
    return [line.strip() for line in recipe.group(1).splitlines() if PROGRAM.match(line.strip())]


def argvs(line: str) -> list[list[str]]:
    """The argument lists a README line stands for: without its optional groups, and with all of them."""
    bare = re.sub(r"\s*\[[^\[\]]*\]", "", line)
    full = re.sub(r"\[([^\[\]]*)\]", r"\1", line)
    found = []
    for text in dict.fromkeys((bare, full)):
        words = shlex.split(text, comments=True)
        assert re.fullmatch(EXECUTABLE, words[0]), line
        unknown = [w for w in words[1:] if re.fullmatch(r"[A-Z][A-Z_]*", w) and w not in EXAMPLES]
        assert not unknown, f"{line!r}: give the placeholders {unknown} an example value in EXAMPLES"
        found.append([EXAMPLES.get(w, w) for w in words[1:]])
    return found


COMMANDS = code_lines() + [s for s in inline_spans() if not s.endswith("...")]


def test_the_readme_shows_the_commands_this_test_expects() -> None:
    """The extraction itself: a README rewrite that hid its commands from it would pass everything below."""
    assert len(code_lines()) >= 11  # the "Command line" block
    assert "kvgate serve --config gateway.yaml" in inline_spans()
    assert ".venv/bin/kvgate serve --model /path/to/model" in inline_spans()  # Set up
    assert "make serve" in README and makefile_lines("serve")
    for family in (s.removesuffix("...").strip() for s in inline_spans() if s.endswith("...")):
        assert any(c.startswith(family + " ") for c in COMMANDS), f"no `{family} ...` command is shown"


@pytest.mark.parametrize("line", COMMANDS + makefile_lines("serve"), ids=lambda line: line.split(" #")[0].strip())
def test_every_readme_command_parses_as_written(line: str) -> None:
    for argv in argvs(line):
        try:
            args = cli.parse(argv)
            if hasattr(args, "rest"):  # a benchmark with a command line of its own: its parser reads the rest
                args = importlib.import_module(args.module).parser().parse_args(args.rest)
        except SystemExit as exc:
            pytest.fail(f"`kvgate {shlex.join(argv)}` (README: {line!r}) does not parse: exit {exc.code}")
        # Each flag as written is an option of that command (not an abbreviation argparse let through),
        # and its value arrives as written.
        for i, word in enumerate(argv):
            if not word.startswith("--"):
                continue
            dest = word[2:].replace("-", "_")
            assert hasattr(args, dest), f"{line!r}: {word} is not the full name of an option"
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
            parsed = getattr(args, dest)
            shown = ",".join(map(str, parsed)) if isinstance(parsed, tuple | list) else str(parsed)  # a list option
            assert value is True and parsed is True or shown == value, (line, word)


def test_main_stops_where_parse_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam is honest: `main` reads its command line through `parse` and nothing else."""

    class Parsed(Exception):
        pass

    def parse(argv: list[str] | None = None) -> None:
        raise Parsed(argv)

    monkeypatch.setattr(cli, "parse", parse)
    with pytest.raises(Parsed) as seen:
        cli.main(["serve", "--config", "gateway.yaml"])
    assert seen.value.args == (["serve", "--config", "gateway.yaml"],)


def test_the_readme_settings_file_is_valid() -> None:
    from kvgate.gateway.settings import Settings

    (block,) = re.findall(r"^```yaml\n(.*?)^```", README, re.S | re.M)
    settings = Settings(**yaml.safe_load(block))
    assert settings.proxy.upstreams and settings.security.api_keys and settings.security.admin_key


def test_serve_with_a_config_file_proxies_to_an_upstream(tmp_path: Path) -> None:
    """`kvgate serve --config gateway.yaml`, run as written from the folder that holds gateway.yaml: a
    proxy-mode front (semantic cache off: no embedding model to load) over the stub upstream."""
    (argv,) = argvs("kvgate serve --config gateway.yaml")
    assert "kvgate serve --config gateway.yaml" in inline_spans()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}  # the file alone decides
    port = free_port()
    with serve_upstream(models=("stub-a",)) as upstream:
        config = {
            "operations": {"host": "127.0.0.1", "port": port},
            "cache_dir": str(tmp_path / "cache"),
            "semantic_cache": {"enabled": False},
            "proxy": {"upstreams": [{"name": "stub", "base_url": f"{upstream}/v1", "models": ["stub-a"]}]},
        }
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
        log = (tmp_path / "serve.log").open("w")
        began = time.monotonic()
        proc = subprocess.Popen([KVGATE, *argv], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            while True:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                try:
                    if loopback.get(f"{url}/ready", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() - began < 120, "kvgate serve did not become ready"
                time.sleep(0.1)
            print(f"ready in {time.monotonic() - began:.2f} s")
            body = {"model": "stub-a", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
            answer = loopback.post(f"{url}/v1/chat/completions", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == "w0 w1 w2 w3 w4 w5 w6 w7 "
            assert answer.headers["x-kvgate-upstream"] == "stub"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                log.close()
    # A clean shutdown: uvicorn finishes, then dies of the SIGTERM it caught again (as it does since 0.29).
    assert proc.returncode in (0, -signal.SIGTERM), (tmp_path / "serve.log").read_text()
    assert "Finished server process" in (tmp_path / "serve.log").read_text()
