"""One adapter per engine behind one interface: compile a Spec, make a matcher, fill its bitmask, consume a token.

Every engine writes the same int32 bitmask (bit i of word j: token 32*j+i allowed), so the rest of the benchmark
is engine-neutral. Each adapter imports its engine in __init__: one that is not installed raises ImportError.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from transformers import PreTrainedTokenizerBase

from .schemas import ITEM_SEP, KEY_SEP, TOOL_CLOSE, TOOL_OPEN, Spec


class Engine(Protocol):
    name: str
    package: str  # the distribution, for its version
    compact: bool  # True: separators "," ":" (the engine cannot emit ", " ": " deterministically)
    cache_note: str

    def build_tokenizer(self, tok: PreTrainedTokenizerBase) -> None: ...
    def compile(self, spec: Spec) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def fill_batch(self, ms: Sequence[Any], bitmask: torch.Tensor) -> None: ...
    def consume(self, m: Any, token: int) -> bool: ...
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None: ...


class LLGuidance:
    name = "llguidance"
    package = "llguidance"
    compact = False
    cache_note = "none built in; recompile = new LLMatcher from the grammar string, or deep_copy a template"

    def __init__(self, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.hf = llguidance.hf
        self.lt = llguidance.torch
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.tokenizer: Any = None
        self.xg = {"whitespace_flexible": False, "item_separator": ITEM_SEP, "key_separator": KEY_SEP}

    def build_tokenizer(self, tok: PreTrainedTokenizerBase) -> None:
        self.tokenizer = self.hf.from_tokenizer(cast(Any, tok))

    def grammar(self, spec: Spec) -> str:
        schema = dict(spec.schema, **{"x-guidance": self.xg})
        if spec.kind == "json":
            return str(self.llg.LLMatcher.grammar_from_json_schema(schema))
        call = f'"<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'
        if spec.kind == "tool_call":
            return str(self.llg.LLMatcher.grammar_from_lark(f"start: {call}\n"))
        return str(self.llg.LLMatcher.grammar_from_lark(f'start: call ("\\n" call)*\ncall: {call}\n'))

    def compile(self, spec: Spec) -> Any:
        m = self.llg.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self.lt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms: Sequence[Any], bitmask: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def consume(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token)) and not m.is_error()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.lt.apply_token_bitmask_inplace(logits, bitmask)


class XGrammar:
    name = "xgrammar"
    package = "xgrammar"
    compact = False
    cache_note = "GrammarCompiler cache (keyed by schema/grammar + options)"

    def __init__(self, threads: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.threads = threads
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.compiler: Any = None

    def build_tokenizer(self, tok: PreTrainedTokenizerBase) -> None:
        info = self.xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=True)

    def compile(self, spec: Spec) -> Any:
        fmt: dict[str, Any] = {"any_whitespace": False, "separators": (ITEM_SEP, KEY_SEP)}
        if spec.kind == "json":
            return self.compiler.compile_json_schema(spec.schema, **fmt)
        g = self.xgr.Grammar
        call = g.concat(
            g.from_ebnf('root ::= "<tool_call>\\n"'),
            g.from_json_schema(spec.schema, **fmt),
            g.from_ebnf('root ::= "\\n</tool_call>"'),
        )
        if spec.kind == "tool_call":
            return self.compiler.compile_grammar(call)
        ebnf = str(call)  # root ::= call ("\n" call)*, the call's rules renamed into one EBNF
        return self.compiler.compile_grammar(
            g.from_ebnf(ebnf.replace("root ::=", "call ::=", 1) + '\nroot ::= call ("\\n" call)*\n')
        )

    def compile_structural_tag(self, spec: Spec) -> Any:
        """The same wrapper as a structural tag (no separators option inside: whitespace stays flexible)."""
        tag: dict[str, Any] = {
            "type": "tag",
            "begin": TOOL_OPEN,
            "content": {"type": "json_schema", "json_schema": spec.schema},
            "end": TOOL_CLOSE,
        }
        fmt = tag
        if spec.kind == "tool_calls":
            fmt = {"type": "tags_with_separator", "separator": "\n", "at_least_one": True, "tags": [tag]}
        return self.compiler.compile_structural_tag({"type": "structural_tag", "format": fmt})

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms: Sequence[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(list(ms), bitmask)

    def consume(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


def regex_literal(text: str) -> str:
    """`text` as a regex that matches exactly it (outlines-core's regex dialect)."""
    return "".join("\\n" if ch == "\n" else "\\" + ch if ch in r"\.+*?()|[]{}^$#&-~" else ch for ch in text)


class OutlinesCore:
    name = "outlines-core"
    package = "outlines-core"
    compact = True
    cache_note = "none; the caller keeps the Index (recompile = rebuild the Index)"

    def __init__(self, threads: int) -> None:  # single-threaded: `threads` is not used
        import outlines_core
        import outlines_core.kernels.torch

        self.oc = outlines_core
        self.kernels = outlines_core.kernels.torch
        self.vocab: Any = None

    def build_tokenizer(self, tok: PreTrainedTokenizerBase) -> None:
        # Vocabulary.from_pretrained reaches the Hub; offline, the byte-level vocabulary is built by hand.
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        u2b = {u: b for b, u in bytes_to_unicode().items()}
        special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        by_bytes: dict[bytes, list[int]] = {}
        for piece, tid in tok.get_vocab().items():
            if tid in special:
                continue
            raw = bytes(u2b[c] for c in piece) if all(c in u2b for c in piece) else piece.encode()
            by_bytes.setdefault(raw, []).append(tid)
        self.vocab = self.oc.Vocabulary(int(tok.eos_token_id), by_bytes)

    def regex(self, spec: Spec) -> str:
        body = self.oc.json_schema.build_regex_from_schema(json.dumps(spec.schema), whitespace_pattern="")
        if spec.kind == "json":
            return str(body)
        call = regex_literal(TOOL_OPEN) + f"({body})" + regex_literal(TOOL_CLOSE)
        return call if spec.kind == "tool_call" else f"{call}(\\n{call})*"

    def compile(self, spec: Spec) -> Any:
        return self.oc.Index(self.regex(spec), self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        r = bitmask[row]
        m.write_mask_into(r.data_ptr(), r.numel(), 4)

    def fill_batch(self, ms: Sequence[Any], bitmask: torch.Tensor) -> None:
        # No batch API: a loop, inlined (not via self.fill) so the timing carries no extra call per row.
        for i, m in enumerate(ms):
            r = bitmask[i]
            m.write_mask_into(r.data_ptr(), r.numel(), 4)

    def consume(self, m: Any, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.kernels.apply_token_bitmask_inplace(logits, bitmask)


# By name, in the order they run; each takes the thread count for its parallel/batched mask API.
ENGINES: dict[str, Callable[[int], Engine]] = {
    "llguidance": LLGuidance,
    "xgrammar": XGrammar,
    "outlines-core": OutlinesCore,
}
