"""`make mutation`: mutmut over the modules that carry the README's promises, with the tests that pin them.

mutmut mutates a copy of the source under `mutants/` and names each mutant by the file's path, while the
trampoline it plants reports the importing module's name. The repository maps its top-level folders into
one `kvgate` package, so the copy is staged with the installed layout (`kvgate/runtime/...`) in which
both names agree. Not part of CI: a full run takes hours on two cores. TESTING.md has the last report.

    python -m tests.mutation [--stage DIR] [--only MODULE ...] [--report FILE]
    python -m tests.mutation --only runtime/blend.py --promises --sample 40   # the model-backed modules

A module whose tests run the model takes hours whole; `--promises` runs every mutant of the functions that
keep its README promises (PROMISES) and `--sample N` a seeded random N of the rest of each module's.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"gateway": "gateway", "runtime": "runtime", "chunk_cache": "chunk_cache",
            "semantic_cache": "semantic_cache", "agents": "agents", "bench": "benchmarks"}  # fmt: skip

# Module (as installed) -> the test files that pin its promises.
TARGETS: dict[str, list[str]] = {
    "chunk_cache/entry.py": [
        "unit/test_chunk_cache.py",
        "unit/test_disk_tier.py",
        "unit/test_memory_tier.py",
        "unit/test_codec.py",
    ],
    "runtime/reuse.py": [
        "unit/test_reuser.py",
        "server/test_tenant_kv.py",
        "server/test_documents.py",
        "unit/test_blend.py",
    ],
    "runtime/prefix.py": ["unit/test_prefix.py", "server/test_prefix_gateway.py", "server/test_tenant_kv.py"],
    "runtime/kv.py": ["unit/test_kv.py", "unit/test_model.py"],
    "runtime/chunks.py": ["unit/test_chunks.py", "server/test_chunks_gateway.py", "server/test_tenant_kv.py"],
    "gateway/keys.py": [
        "server/test_keys.py",
        "server/test_auth.py",
        "unit/test_key_store.py",
        "abuse/test_isolation.py",
    ],
    "gateway/limits.py": ["unit/test_limits.py", "unit/test_limits_redis.py"],
    "semantic_cache/guards.py": ["unit/test_guards.py"],
    "semantic_cache/cache.py": [
        "unit/test_semantic_cache.py",
        "server/test_semantic_gateway.py",
        "server/test_semantic_feedback.py",
        "unit/test_semantic_bound.py",
        "unit/test_semantic_redis.py",
    ],
    "runtime/rope.py": ["unit/test_rope.py", "unit/test_rope_configs.py"],
    "runtime/blend.py": ["unit/test_blend_selection.py", "unit/test_blend.py"],
    "runtime/caching.py": [
        "unit/test_caching.py",
        "unit/test_fidelity.py",
        "unit/test_quality.py",
        "unit/test_calibration.py",
        "unit/test_in_context.py",
    ],
    "runtime/prompt_kv.py": [
        "unit/test_caching.py",
        "unit/test_exact.py",
        "unit/test_prefix.py",
        "unit/test_in_context.py",
        "unit/test_quality.py",
    ],
    "runtime/scheduler.py": ["unit/test_scheduler.py"],
    "agents/queue.py": ["unit/test_programs.py", "unit/test_scheduler.py", "unit/test_queue.py"],
    "gateway/proxy.py": [
        "server/test_proxy.py",
        "server/test_proxy_relay.py",
        "test_proxy_events.py",
        "server/test_proxy_kvgate.py",
        "server/test_workers.py",
        "server/test_metrics.py",
        "abuse/test_proxy_bounds.py",
    ],
    "gateway/outgoing.py": ["server/test_outgoing.py", "server/test_proxy.py", "server/test_workers.py"],
}
# Module -> the functions (as mutmut mangles them) that keep its promises, for the modules too slow to run whole:
# tenant scoping of document and prefix KV, the blend's placement and selection, the fidelity a reply reports,
# the stored calibration, the semantic cache's tenant scoping, the proxy's relay.
PROMISES: dict[str, list[str]] = {
    "runtime/reuse.py": [
        "x_copy_prefix", "xǁReuserǁkey", "xǁReuserǁdocument", "xǁReuserǁmissing", "xǁReuserǁcached",
    ],
    "runtime/prefix.py": ["xǁBlocksǁkey", "xǁBlocksǁroot", "xǁBlocksǁattach", "xǁBlocksǁbranch", "xǁBlocksǁkeep"],
    "runtime/chunks.py": ["x_cut", "xǁChunksǁkey", "xǁChunksǁfind", "xǁChunksǁkeep", "xǁChunksǁremember"],
    "runtime/blend.py": ["x_place", "x_choose", "x_first_tokens"],
    "runtime/caching.py": ["xǁCachesǁfidelity", "xǁCachesǁchoose", "xǁCachesǁtargets"],
    # The relay (SSE re-framing, bounds, errors after the first byte) and documents never sent past kvgate's
    # own workers, with the tenant's name only ever sent to them hashed.
    "gateway/proxy.py": [
        "xǁUpstreamsǁforward", "xǁUpstreamsǁadd_document", "xǁUpstreamsǁdocument", "xǁUpstreamsǁsend_document",
        "x_whole", "x_failed", "xǁEventsǁfeed", "xǁEventsǁrest", "x_event_data", "xǁRelayǁevents",
        "xǁRelayǁread", "xǁRelayǁread_whole",
    ],
    "gateway/outgoing.py": ["x_headers_for", "x_pasted_documents"],
    "semantic_cache/cache.py": [
        "xǁSemanticCacheǁlookup", "xǁSemanticCacheǁfind", "xǁSemanticCacheǁinvalidate", "xǁSemanticCacheǁremember",
        "xǁSemanticCacheǁreport",
    ],
}  # fmt: skip
KILLED = ("killed", "timeout", "caught by type check", "segfault")


def status(code: int | None) -> str:
    from mutmut.stats import status_by_exit_code  # mutmut is installed by `make mutation` only

    return status_by_exit_code[code]


def stage(out: Path, modules: list[str], only_tests: list[str] | None = None) -> None:
    """Copy the package in its installed layout, the tests, and a pyproject with mutmut's settings;
    `only_tests`: these of the modules' test files, not all of them."""
    if out.exists():
        shutil.rmtree(out)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "kvgate", out / "kvgate", ignore=ignore)
    for name, folder in PACKAGES.items():
        shutil.copytree(ROOT / folder, out / "kvgate" / name, ignore=ignore)
    shutil.copytree(ROOT / "tests", out / "tests", ignore=ignore)
    tests = sorted({f"tests/{t}" for m in modules for t in TARGETS[m] if only_tests is None or t in only_tests})
    (out / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        'source_paths = ["kvgate"]\n'
        f"only_mutate = {json.dumps(['kvgate/' + m for m in modules])}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n'
        # A fork of the process that ran the tests can inherit a lock another thread held (the disk tier's
        # writer, torch's pool) and hang: five of the first six entry.py mutants timed out, counted as killed.
        'process_isolation = "forkserver"\n'
        "[tool.pytest.ini_options]\n"
        "timeout = 900\n"  # mutmut's trampolines slow the model's hot paths
        'filterwarnings = ["ignore::DeprecationWarning"]\n'
    )


ENV = {**os.environ, "PYTHONPATH": ""}  # the staged copy, not the editable install, must be found
# mutmut 3.8.1's first step alone (what `mutmut run` does before it runs anything): write the mutants.
GENERATE = (
    "from mutmut.__main__ import create_mutants\n"
    "from mutmut.mutation.trampoline import set_mutant_under_test\n"
    "from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths\n"
    "set_mutant_under_test('mutant_generation')\n"
    "copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(1)\n"
)


def mutants(out: Path) -> dict[str, dict[str, int | None]]:
    """Per module, each mutant's exit code (None: not run), from mutmut's meta files."""
    found: dict[str, dict[str, int | None]] = {}
    for meta in sorted((out / "mutants" / "kvgate").rglob("*.py.meta")):
        module = str(meta.relative_to(out / "mutants" / "kvgate"))[: -len(".meta")]
        found[module] = json.loads(meta.read_text())["exit_code_by_key"]
    return found


def chosen(out: Path, promises: bool, sample: int, seed: int) -> list[str]:
    """The mutants of the promise-keeping functions and a seeded sample of the others, per module; all of them
    when neither is asked. Only those not decided yet (see `carry`)."""
    names: list[str] = []
    found = mutants(out)
    for module, codes in found.items():
        if not (promises or sample):
            names += list(codes)
            continue
        keep = tuple(f"{fn}__mutmut_" for fn in PROMISES.get(module, [])) if promises else ()
        own = [n for n in codes if n.rsplit(".", 1)[1].startswith(keep)] if keep else []
        rest = sorted(set(codes) - set(own))
        names += own + random.Random(seed).sample(rest, min(sample, len(rest)))
    decided = {n for codes in found.values() for n, code in codes.items() if code is not None}
    return [n for n in names if n not in decided]


def mutant_sources(path: Path) -> dict[str, str]:
    """Each mutant's function, as source, in a staged file of mutants (by its name in mutmut's meta)."""
    text = path.read_text()
    return {
        node.name: ast.get_source_segment(text, node) or ""
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "__mutmut_" in node.name
    }


def carry(earlier: Path, out: Path) -> None:
    """Mark killed the mutants an earlier stage's tests killed, where the mutant's function is the same
    source in both stages (a function changed since gets its mutants run again)."""
    for meta in sorted((out / "mutants" / "kvgate").rglob("*.py.meta")):
        before = earlier / meta.relative_to(out)
        if not before.exists():
            continue
        old = json.loads(before.read_text())["exit_code_by_key"]
        data = json.loads(meta.read_text())
        then, now = mutant_sources(before.with_suffix("")), mutant_sources(meta.with_suffix(""))
        for name, code in old.items():
            function = name.rsplit(".", 1)[-1]
            unchanged = function in now and then.get(function) == now[function]
            if name in data["exit_code_by_key"] and unchanged and code is not None and status(code) in KILLED:
                data["exit_code_by_key"][name] = code
        meta.write_text(json.dumps(data, indent=4))


def run(out: Path, children: int, names: list[str]) -> None:
    subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *names], cwd=out, env=ENV, check=False
    )


def promised(module: str, name: str) -> bool:
    return any(f".{fn}__mutmut_" in name for fn in PROMISES.get(module, []))


def results(out: Path) -> dict[str, Counter[str]]:
    """Per module, how many mutants ended how; and apart, those of its promise-keeping functions."""
    counts: dict[str, Counter[str]] = {}
    for module, codes in mutants(out).items():
        counts[module] = Counter(status(c) for c in codes.values())
        if module in PROMISES:
            own = [c for n, c in codes.items() if promised(module, n)]
            counts[f"{module}, promise functions"] = Counter(status(c) for c in own)
    return counts


def survivors(out: Path) -> list[str]:
    """Each surviving mutant as its name and the line it changes (from `mutmut show`)."""
    lines: list[str] = []
    for module, codes in mutants(out).items():
        for name, code in codes.items():
            if status(code) not in ("survived", "no tests"):
                continue
            shown = subprocess.run(
                [sys.executable, "-m", "mutmut", "show", name], cwd=out, capture_output=True, text=True
            )
            changed = [ln[1:].strip() for ln in shown.stdout.splitlines() if re.match(r"^\+(?!\+)", ln)]
            where = ", promise" if promised(module, name) else ""
            lines.append(f"- `{name}` ({status(code)}{where}): `{changed[0] if changed else '?'}`")
    return lines


def row(name: str, c: Counter[str]) -> str:
    """Counts of the mutants tested; those a stopped run never reached ("not checked") are only listed."""
    n = sum(c.values()) - c["not checked"]
    killed = sum(c[k] for k in KILLED)
    return (f"| {name} | {n} | {killed} | {c['survived']} | {c['no tests']} | {c['timeout']} | "
            f"{100 * killed / max(n, 1):.1f}% | {c['not checked']} |")  # fmt: skip


def report(counts: dict[str, Counter[str]], survived: list[str]) -> str:
    rows = ["| module | mutants | killed | survived | no tests | timeout | killed % | not run |", "|---" * 8 + "|"]
    rows += [row(module, c) for module, c in counts.items()]
    whole = [c for module, c in counts.items() if not module.endswith("promise functions")]
    rows.append(row("**all**", sum(whole, Counter[str]())))
    return "\n".join(rows) + "\n\nSurvivors:\n\n" + ("\n".join(survived) or "none") + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=Path, default=ROOT / "build" / "mutation")
    parser.add_argument("--only", nargs="*", choices=sorted(TARGETS), default=sorted(TARGETS))
    parser.add_argument("--children", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--report", type=Path, help="also write the report here")
    parser.add_argument("--promises", action="store_true", help="only the promise-keeping functions' mutants...")
    parser.add_argument("--sample", type=int, default=0, help="...and this many others per module, at random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--killed-in", type=Path, help="an earlier stage whose killed mutants are not run again")
    parser.add_argument("--report-only", action="store_true", help="report on the staged run, do not run")
    parser.add_argument(
        "--tests", nargs="+", help="only these of TARGETS' test files (a mutant they kill, all of them kill)"
    )
    args = parser.parse_args(argv)
    if not args.report_only:
        unknown = set(args.tests or ()) - {t for m in args.only for t in TARGETS[m]}
        if unknown:
            parser.error(f"not a test file of {' '.join(args.only)}: {', '.join(sorted(unknown))}")
        stage(args.stage, args.only, args.tests)
        subprocess.run([sys.executable, "-c", GENERATE], cwd=args.stage, env=ENV, check=True, capture_output=True)
        if args.killed_in:
            carry(args.killed_in, args.stage)
        names = chosen(args.stage, args.promises, args.sample, args.seed)
        if names:
            run(args.stage, args.children, names)
    text = report(results(args.stage), survivors(args.stage))
    print(text)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)


if __name__ == "__main__":
    main()
