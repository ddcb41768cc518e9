"""runtime/prompt_kv.py: a sequence's prompt KV has one writer, its PromptKV. The engine asks it for runs and tells it
when one is done; nothing else in the product assigns its fields or changes what they hold (read with `ast`, as
tests/unit/test_layers.py reads the tree). Its behaviour is the suite's reuse tests (test_caching, test_exact, ...)."""

from __future__ import annotations

import ast

from tests.unit.test_layers import FOLDERS, ROOT

OWNER = "runtime/prompt_kv.py"
MUTATORS = {"append", "extend", "insert", "pop", "popleft", "remove", "clear", "update", "add", "discard", "setdefault"}


def through_prompt(node: ast.expr) -> bool:
    """Whether `node` is `<x>.prompt.<field>` (or deeper)."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "prompt":
            return True
        node = node.value
    return False


def writes(source: str) -> list[int]:
    """Lines of `source` that assign, delete or change in place a field reached through `.prompt.`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            if any(through_prompt(t) for t in flat):
                found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            if through_prompt(node.func.value):
                found.append(node.lineno)
    return sorted(found)


def test_nothing_but_its_owner_writes_a_prompts_kv_state() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in FOLDERS
        for path in sorted((ROOT / folder).glob("*.py"))
        if str(path.relative_to(ROOT)) != OWNER
        for line in writes(path.read_text())
    ]
    assert not offenders, "PromptKV's state written from outside it: " + ", ".join(offenders)


def test_each_kind_of_write_from_outside_is_found() -> None:
    source = """
seq.prompt.cached_tokens = 3
seq.prompt.kept += 64
a, seq.prompt.reuse = 1, "prefix"
seq.prompt.missing.pop(0)
seq.prompt.fresh["key"] = None
del seq.prompt.shared
"""
    assert writes(source) == [2, 3, 4, 5, 6, 7]
    assert writes("n = seq.prompt.cached_tokens\nseq.prompt.settle(caches)\nself.prompt = p\n") == []
