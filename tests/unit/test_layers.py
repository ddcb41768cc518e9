"""The source tree's shape, read with `ast` (nothing here imports the code it checks).

Dependencies point one way (DESIGN.md), no module-level import cycle, and no file over 400 lines.
The checkers take a root and a folder mapping, so they are tested on tiny synthetic trees too.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
MAX_FUNCTION = 80  # a product function's lines stay under this (a benchmark's run reads as a script: not held to it)
FOLDERS = (
    "kvgate",
    "kvgate/integrations",
    "gateway",
    "runtime",
    "chunk_cache",
    "semantic_cache",
    "agents",
    "benchmarks",
)

# What each kvgate package may import of kvgate. One row per package; the arrows point down.
GATEWAY, RUNTIME, AGENTS = "kvgate.gateway", "kvgate.runtime", "kvgate.agents"
CHUNK, SEMANTIC, BENCH, TOP = "kvgate.chunk_cache", "kvgate.semantic_cache", "kvgate.bench", "kvgate"
INTEGRATIONS = "kvgate.integrations"
ALL = {TOP, INTEGRATIONS, GATEWAY, RUNTIME, AGENTS, CHUNK, SEMANTIC, BENCH}
MAY_IMPORT: dict[str, set[str]] = {
    BENCH: ALL - {INTEGRATIONS},  # the benchmarks sit on top of everything
    INTEGRATIONS: {INTEGRATIONS, TOP},  # LangChain, LlamaIndex: over the SDK
    TOP: ALL - {BENCH, INTEGRATIONS},  # the public surface: Client, LLM, Settings
    GATEWAY: ALL - {BENCH, TOP, INTEGRATIONS},  # the CLI reaches `kvgate bench` by an entry point (pyproject.toml)
    RUNTIME: {RUNTIME, AGENTS, CHUNK},
    AGENTS: {AGENTS, CHUNK},
    CHUNK: {CHUNK},
    SEMANTIC: {SEMANTIC},
}


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """pyproject.toml's package-dir mapping: import package -> folder."""
    with (root / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def modules(root: Path, dirs: dict[str, str]) -> dict[str, Path]:
    """Every module of the mapped folders, by its import name."""
    found = {}
    for package, folder in dirs.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the most specific known module it names (or the name as written)
    line: int
    in_function: bool
    type_checking: bool

    @property
    def module_level(self) -> bool:
        return not self.in_function and not self.type_checking

    def __str__(self) -> str:
        where = " (in a function)" if self.in_function else " (if TYPE_CHECKING)" if self.type_checking else ""
        return f"{self.source}:{self.line} imports {self.target}{where}"


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.module, self.known, self.found = module, known, []
        self.package = module if is_package else module.rpartition(".")[0]
        self.functions = self.type_checking = 0

    def add(self, node: ast.AST, name: str) -> None:
        self.found.append(Import(self.module, name, node.lineno, self.functions > 0, self.type_checking > 0))

    def specific(self, name: str) -> str:
        """`a.b.c` -> the longest of a.b.c, a.b, a that is a known module (the name itself if none)."""
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in self.known:
                return ".".join(parts[:n])
        return name

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(node, self.specific(alias.name))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)] if node.level - 1 < len(base) else []
            base_name = ".".join(base + ([node.module] if node.module else []))
        else:
            base_name = node.module or ""
        for alias in node.names:
            # `from pkg import sub` names the submodule when there is one, else pkg itself.
            full = f"{base_name}.{alias.name}"
            self.add(node, full if full in self.known else self.specific(base_name))

    def visit_Call(self, node: ast.Call) -> None:
        # importlib.import_module("kvgate.x") / __import__("kvgate.x"): an import all the same.
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in {"import_module", "__import__"} and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
                self.add(node, self.specific(arg.value))
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.attr if isinstance(test, ast.Attribute) else test.id if isinstance(test, ast.Name) else ""
        if name != "TYPE_CHECKING":
            self.generic_visit(node)
            return
        self.type_checking += 1
        for child in node.body:
            self.visit(child)
        self.type_checking -= 1
        for child in node.orelse:
            self.visit(child)


def imports(root: Path, dirs: dict[str, str]) -> list[Import]:
    """Every import of a kvgate module in the mapped folders: module-level, in functions, type-only."""
    mods = modules(root, dirs)
    found = []
    for module, path in mods.items():
        visitor = _Imports(module, path.name == "__init__.py", set(mods))
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        found += [i for i in visitor.found if i.target == "kvgate" or i.target.startswith("kvgate.")]
    return found


def layer_of(module: str, dirs: dict[str, str]) -> str:
    return max((p for p in dirs if module == p or module.startswith(p + ".")), key=len, default=module)


def layer_violations(root: Path = ROOT, dirs: dict[str, str] | None = None) -> list[str]:
    dirs = dirs or package_dirs(root)
    bad = []
    for imp in imports(root, dirs):
        source, target = layer_of(imp.source, dirs), layer_of(imp.target, dirs)
        if target not in MAY_IMPORT.get(source, set()):
            bad.append(f"{imp}: {source} may not import {target}")
    return list(dict.fromkeys(bad))  # `from m import a, b` is one line


def import_graph(root: Path, dirs: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the kvgate modules it imports at module level (not in functions, not if TYPE_CHECKING)."""
    graph: dict[str, set[str]] = {m: set() for m in modules(root, dirs)}
    for imp in imports(root, dirs):
        if imp.module_level and imp.target in graph and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as [a, b, ..., a], or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                node = path.pop()
                on_path.discard(node)
                done.add(node)
            elif nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def long_files(folders: list[Path], limit: int = MAX_LINES) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(folder.parent)}: {lines} lines")
    return found


def long_functions(folders: list[Path], limit: int = MAX_FUNCTION) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines >= limit:
                        found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name}: {lines} lines")
    return found


# The tree as it is.


def test_dependencies_point_one_way() -> None:
    bad = layer_violations()
    assert not bad, "imports against the layering (DESIGN.md):\n" + "\n".join(bad)


def test_no_module_level_import_cycle() -> None:
    cycle = find_cycle(import_graph(ROOT, package_dirs()))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


def test_no_import_loop_between_folders() -> None:
    """What each package may import is itself one way: no two folders may import each other, however far round."""
    allowed = {package: targets - {package} for package, targets in MAY_IMPORT.items()}
    cycle = find_cycle(allowed)
    assert cycle is None, "packages allowed to import each other: " + " -> ".join(cycle or [])


def test_no_source_file_over_400_lines() -> None:
    folders = [ROOT / folder for folder in package_dirs().values()] + [ROOT / "tests"]
    found = long_files(folders)
    assert not found, f"files over {MAX_LINES} lines:\n" + "\n".join(found)


def test_no_product_function_of_80_lines_or_more() -> None:
    folders = [ROOT / folder for package, folder in package_dirs().items() if package != BENCH]
    found = long_functions(folders)
    assert not found, f"product functions of {MAX_FUNCTION} lines or more:\n" + "\n".join(found)


def test_the_checked_folders_are_the_ones_the_wheel_ships() -> None:
    dirs = package_dirs()
    assert set(dirs) == ALL
    assert set(dirs.values()) == set(FOLDERS)
    assert len(modules(ROOT, dirs)) > 50


# The checkers themselves, on a tiny tree.

DIRS = {TOP: "kvgate", GATEWAY: "gateway", RUNTIME: "runtime", AGENTS: "agents", CHUNK: "chunk_cache", BENCH: "bench"}


def tree(root: Path, files: dict[str, str]) -> Path:
    for folder in DIRS.values():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").touch()
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "runtime/engine.py": "from kvgate.chunk_cache import store\nfrom ..agents import programs\n",
            "chunk_cache/store.py": "from . import key\nimport kvgate.chunk_cache.key\n",
            "chunk_cache/key.py": "",
            "agents/programs.py": "from kvgate.chunk_cache.key import x\n",
            "gateway/cli.py": "from kvgate.runtime import engine\n",
            "bench/ttft.py": "from kvgate.gateway import cli\nfrom kvgate import bench\n",
            "kvgate/client.py": "from kvgate.gateway.cli import x\n",
        },
    )
    assert layer_violations(root, DIRS) == []
    assert find_cycle(import_graph(root, DIRS)) is None


def test_each_wrong_way_import_is_found(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "chunk_cache/store.py": "def f():\n    from kvgate.runtime import engine\n",  # in a function too
            "agents/programs.py": "from ..runtime import engine\n",  # relative
            "runtime/engine.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvgate import client\n",
            "runtime/kv.py": "import importlib\nM = importlib.import_module('kvgate.gateway.cli')\n",
            "gateway/cli.py": "def f():\n    from kvgate.bench.ttft import a, b\n",  # the CLI, in a function
            "gateway/app.py": "import kvgate.bench.ttft\n",
            "kvgate/client.py": "from kvgate import bench\n",
            "bench/ttft.py": "",
        },
    )
    found = "\n".join(layer_violations(root, DIRS))
    for line in [
        "kvgate.chunk_cache.store:2 imports kvgate.runtime.engine (in a function): kvgate.chunk_cache may not",
        "kvgate.agents.programs:1 imports kvgate.runtime.engine: kvgate.agents may not import kvgate.runtime",
        "kvgate.runtime.engine:3 imports kvgate.client (if TYPE_CHECKING): kvgate.runtime may not import kvgate",
        "kvgate.runtime.kv:2 imports kvgate.gateway.cli: kvgate.runtime may not import kvgate.gateway",
        "kvgate.gateway.cli:2 imports kvgate.bench.ttft (in a function): kvgate.gateway may not",
        "kvgate.gateway.app:1 imports kvgate.bench.ttft: kvgate.gateway may not import kvgate.bench",
        "kvgate.client:1 imports kvgate.bench: kvgate may not import kvgate.bench",
    ]:
        assert line in found
    assert len(found.splitlines()) == 7


def test_a_module_level_cycle_is_found_and_named(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "runtime/a.py": "from kvgate.runtime import b\n",
            "runtime/b.py": "from .c import x\n",
            "runtime/c.py": "import kvgate.runtime.a\n",
        },
    )
    assert find_cycle(import_graph(root, DIRS)) == [
        "kvgate.runtime.a",
        "kvgate.runtime.b",
        "kvgate.runtime.c",
        "kvgate.runtime.a",
    ]
    # The same back edge inside a function, or only for type checkers, is no cycle at import time.
    (root / "runtime/c.py").write_text("def f():\n    import kvgate.runtime.a\n")
    assert find_cycle(import_graph(root, DIRS)) is None
    (root / "runtime/c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import kvgate.runtime.a\n")
    assert find_cycle(import_graph(root, DIRS)) is None
    # A package's __init__ re-exporting a module that imports the package back is one.
    (root / "runtime/__init__.py").write_text("from .a import x\n")
    (root / "runtime/c.py").write_text("from kvgate.runtime import y\n")
    assert find_cycle(import_graph(root, DIRS)) == [
        "kvgate.runtime",
        "kvgate.runtime.a",
        "kvgate.runtime.b",
        "kvgate.runtime.c",
        "kvgate.runtime",
    ]


def test_cycles_off_the_first_path_are_found() -> None:
    graph = {"a": {"b", "c"}, "b": set(), "c": {"d"}, "d": {"c"}}
    assert find_cycle(graph) == ["c", "d", "c"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_a_long_file_is_listed(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_files([tmp_path / "pkg"]) == [f"pkg/long.py: {MAX_LINES + 1} lines"]


def test_a_long_function_is_listed(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    body = "    x = 1\n"
    text = "def ok():\n" + body * (MAX_FUNCTION - 2) + "async def long():\n" + body * (MAX_FUNCTION - 1)
    (tmp_path / "pkg" / "m.py").write_text(text)
    assert long_functions([tmp_path / "pkg"]) == [f"pkg/m.py:{MAX_FUNCTION} long: {MAX_FUNCTION} lines"]
