"""Constrained decoding with llguidance: what a request's answer may be, as a grammar, and the
mask of allowed tokens that each step's sampling applies.

A grammar is built from the request (runtime/tools.py's format for tool calls, JSON schemas for
`response_format`), compiled and checked once per request, and matched token by token per
sequence. JSON is written with fixed separators and no free whitespace, `json.dumps`'s own, so
a call or an object rendered back into a later prompt gives the tokens the model produced.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

from kvgate.runtime.errors import GrammarError
from kvgate.runtime.tools import ToolFormat

FORMATTING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Calls:
    """Tool calls a grammar asks for: which functions (name -> JSON schema of its arguments),
    whether the model must call one, and whether it may call several."""

    functions: dict[str, dict[str, Any]]
    required: bool
    parallel: bool


def schema(value: dict[str, Any]) -> dict[str, Any]:
    return {**value, "x-guidance": FORMATTING}


def lit(text: str) -> str:
    return json.dumps(text)


def call_rules(fmt: ToolFormat, functions: dict[str, dict[str, Any]]) -> str:
    """`call`: any one of the functions, written in the model's format. The opening tag is left
    out: the rule that starts a call writes it (or a lazy trigger has already matched it)."""
    rules = []
    for i, (name, args) in enumerate(functions.items()):
        head = lit('{"name": ' + json.dumps(name) + ', "' + fmt.arguments + '": ')
        rules.append(f"call_{i}: {head} %json {json.dumps(schema(args))} {lit('}' + fmt.close)}")
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    return "\n".join([f"call: {alternatives}", *rules])


def calls_grammar(fmt: ToolFormat, calls: Calls, answer: dict[str, Any] | None = None) -> str:
    """Lark for tool calls. Required: calls only. Otherwise free text (or, with `answer`, a JSON
    answer instead of the text) until the model opens a call, which is then held to its schema."""
    more = f"({lit(fmt.separator + fmt.open)} call)*" if calls.parallel else ""
    body = f"call {more}"
    if calls.required:
        start = f"start: {lit(fmt.open)} {body}" if fmt.open else f"start: {body}"
    elif answer is not None:
        start = f"start: %json {json.dumps(schema(answer))} | {lit(fmt.open)} {body}"
    else:
        if not fmt.open:
            raise GrammarError(f"the {fmt.name} tool format has no tag to trigger on")
        start = f"start: TEXT | opened {body}\nopened[lazy]: TEXT {lit(fmt.open)}\nTEXT: /(.|\\n)*/"
    return "%llguidance {}\n" + start + "\n" + call_rules(fmt, calls.functions) + "\n"


def json_grammar(value: dict[str, Any]) -> str:
    return "%llguidance {}\nstart: %json " + json.dumps(schema(value)) + "\n"


class Grammars:
    """The model's tokenizer as llguidance sees it (built on first use: ~0.3 s), compilation and
    checking of grammars, and the masks of a step's constrained sequences."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: frozenset[int]) -> None:
        self.tokenizer, self.eos_ids = tokenizer, sorted(eos_ids)
        self._lltok: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.lock = threading.Lock()
        self.spent_s = 0.0  # in masks and matchers on the engine's thread (the benchmark weighs it against steps)

    @property
    def lltok(self) -> llguidance.LLTokenizer:
        with self.lock:
            if self._lltok is None:
                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos_ids)
                self._executor = llguidance.LLExecutor()
            return self._lltok

    def compile(self, lark: str) -> str:
        """The grammar, checked against this tokenizer (GrammarError when it cannot be used)."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except Exception as exc:  # llguidance raises plain errors for lark it cannot read
            raise GrammarError(str(exc)) from exc
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if failed:
            raise GrammarError(messages[0] if messages else "invalid grammar")
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def masks(
        self, matchers: list[llguidance.LLMatcher], width: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """[len(matchers), width] booleans on `device` (the logits'): the tokens each matcher allows next (filled
        in parallel; the bitmask, 32 tokens a word, is what crosses to the device); tokens past the tokenizer's
        vocabulary (a padded lm_head) are never allowed."""
        start, lltok = time.perf_counter(), self.lltok
        # llguidance.torch's helpers, inlined: importing that module runs torch.compile (2.1 s at every start).
        bits = torch.full((len(matchers), (lltok.vocab_size + 31) // 32), -1, dtype=torch.int32)
        row = bits.shape[1] * bits.element_size()
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bits.data_ptr(), row)
        else:
            assert self._executor is not None
            self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), row,
                                                   len(matchers))  # fmt: skip
        bits = bits.to(device)
        shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, : min(width, lltok.vocab_size)]
        if allowed.shape[1] < width:
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
        self.spent_s += time.perf_counter() - start
        return allowed

    def restrict(self, matcher: llguidance.LLMatcher, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """`logits` with the tokens `allowed` (its mask) leaves out at -inf; GrammarError when it allows none."""
        if not bool(allowed.any()):
            raise GrammarError(f"the grammar allows no token: {matcher.get_error() or 'it is complete'}")
        start = time.perf_counter()
        restricted = logits.masked_fill(~allowed, float("-inf"))
        self.spent_s += time.perf_counter() - start
        return restricted

    def consume(self, matcher: llguidance.LLMatcher, token: int) -> None:
        """Advance the matcher past `token`; GrammarError when the grammar does not let it follow."""
        start = time.perf_counter()
        consumed = matcher.consume_token(token)
        self.spent_s += time.perf_counter() - start
        if not consumed:
            raise GrammarError(matcher.get_error())
