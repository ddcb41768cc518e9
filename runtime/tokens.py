"""Between text and token ids: the chat template, prompt encoding, and each token's bytes."""

from __future__ import annotations

import codecs
import re
import weakref
from collections.abc import Callable
from functools import cache
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvgate.runtime.errors import TemplateError


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    if not tokenizer.chat_template:
        raise TemplateError("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja raises its own errors for messages a template rejects
        raise TemplateError(f"the model's chat template rejected the messages: {exc}") from exc
    # The rendered template already holds the special tokens the model wants.
    return tokenizer.encode(text, add_special_tokens=False)


_decoders: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, Callable[[list[int]], str]] = weakref.WeakKeyDictionary()


def decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, by the Rust tokenizer itself where transformers would add
    nothing to its text (no clean-up of spaces): measured, 0.7 against 2.5 us a call, two calls a token of every
    sequence of a decode step."""
    found = _decoders.get(tokenizer)
    if found is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            found = lambda ids: backend.decode(ids, skip_special_tokens=True)  # noqa: E731
        else:
            found = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        _decoders[tokenizer] = found
    return found


class Detokenizer:
    """A sequence's output text, a token at a time. Each new token costs the same however long the output is.

    Where the tokenizer is byte-level and `decoder` is the Rust decode (GPT-2's alphabet: Llama 3, Qwen, SmolLM),
    a token whose bytes are whole characters is its text, a dict lookup, where decoding beside the text before took
    two calls into the tokenizer (measured: 0.4 ms of a 3 ms step at 64 sequences); the bytes of a character split
    over tokens are held until it is whole. UTF-8 with replacement, a piece at a time or all at once, decodes
    alike, as the tokenizer's lossy decode does.
    Elsewhere the new tokens are decoded beside those of the text before (as vLLM does): a token's text can
    depend on the one before it (a leading space, a character split over byte tokens)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.pieces, self.decode = _pieces(tokenizer), decoder(tokenizer)
        self.held = b""  # the bytes of a character not yet whole (byte-level)
        self.start = self.done = 0  # ids[start:done] decoded before the new ones (not byte-level); ids[:done] done

    def text(self, ids: list[int], end: int, whole: bool) -> str:
        """The text ids[:end] adds (`whole`: all of it, half a character too; else up to the last whole one)."""
        if end <= self.done:
            return ""
        if self.pieces is not None:
            new = [self.add(i) for i in ids[self.done : end]]
            self.done = end
            if whole and self.held:
                new.append(self.held.decode("utf-8", "replace"))
                self.held = b""
            return "".join(new)
        part = ids[self.start : end]
        before, now = self.decode(part[: self.done - self.start]), self.decode(part)
        if len(now) > len(before) and (whole or not now.endswith("\ufffd")):  # else wait for the character's rest
            self.start, self.done = self.done, end
            return now[len(before) :]
        return ""

    def add(self, token_id: int) -> str:
        raw, text = self.pieces(token_id)
        if text is not None and not self.held:  # whole characters after whole characters
            return text
        text, used = codecs.utf_8_decode(self.held + raw, "replace", False)
        self.held = (self.held + raw)[used:]
        return text


class _BytePieces:
    """Each token's bytes as the tokenizer's ByteLevel decoder joins them, and their text where they are whole UTF-8
    characters; a special token (skipped) and an unknown id (the tokenizer drops it) none."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.backend = tokenizer.backend_tokenizer
        self.special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        self.memo: dict[int, tuple[bytes, str | None]] = {}

    def __call__(self, token_id: int) -> tuple[bytes, str | None]:
        found = self.memo.get(token_id)
        if found is None:
            found = self.memo[token_id] = self.piece(token_id)
        return found

    def piece(self, token_id: int) -> tuple[bytes, str | None]:
        piece = None if token_id in self.special else self.backend.id_to_token(token_id)
        raw = b"" if piece is None else byte_level(piece) or piece.encode()  # an added token: its own UTF-8
        try:
            return raw, raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw, None


_byte_pieces: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, _BytePieces | None] = weakref.WeakKeyDictionary()


def _pieces(tokenizer: PreTrainedTokenizerBase) -> _BytePieces | None:
    if tokenizer not in _byte_pieces:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        byte_level = plain and type(backend.decoder).__name__ == "ByteLevel"
        _byte_pieces[tokenizer] = _BytePieces(tokenizer) if byte_level else None
    return _byte_pieces[tokenizer]


def text_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True)


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each printable stand-in char -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def byte_level(piece: str) -> bytes | None:
    """A byte-level token's bytes (None: a piece outside the alphabet)."""
    table = _byte_decoder()
    return bytes(table[c] for c in piece) if all(c in table for c in piece) else None


_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenBytes:
    """The raw bytes of single tokens (OpenAI logprobs carry them: a token may be half a character)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.special = set(tokenizer.all_special_ids)
        self.memo: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        if token_id not in self.memo:
            self.memo[token_id] = self._bytes(token_id)
        return self.memo[token_id]

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self.special or piece is None:
            return (piece or "").encode()
        if self.byte_level and (raw := byte_level(piece)) is not None:
            return raw
        if match := _HEX_BYTE.match(piece):  # sentencepiece byte fallback
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def text(self, token_id: int) -> str:
        return self(token_id).decode("utf-8", errors="replace")
