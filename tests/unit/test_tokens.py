"""runtime/tokens.py: a sequence's text decoded a token at a time equals the tokenizer's decode of all of it."""

from __future__ import annotations

import random

from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.tokens import Detokenizer


def streamed(loaded: LoadedModel, ids: list[int]) -> str:
    detokenizer = Detokenizer(loaded.tokenizer)
    return "".join(detokenizer.text(ids, end, whole=end == len(ids)) for end in range(1, len(ids) + 1))


def test_byte_level_text_a_token_at_a_time_equals_the_whole_decode(loaded: LoadedModel) -> None:
    tokenizer = loaded.tokenizer
    assert Detokenizer(tokenizer).pieces is not None  # the default tokenizer takes the byte path
    sample = "Ünïcode: 日本語テキスト, emoji 🤖🎉, accents e\u0301 and tabs\t\n"
    text = tokenizer.encode(sample, add_special_tokens=False)
    special = sorted(tokenizer.all_special_ids)
    rng = random.Random(0)
    cases = [
        text,
        text[:-1],  # ends inside an emoji's bytes: the rest flushed as the decode's replacement character
        [*text[:5], special[0], *text[5:9], special[-1], len(tokenizer) + 3],  # specials and an unknown id dropped
        *([rng.randrange(len(tokenizer)) for _ in range(40)] for _ in range(30)),
        *([rng.choice(text) for _ in range(40)] for _ in range(30)),  # byte tokens out of order: invalid UTF-8
    ]
    for ids in cases:
        assert streamed(loaded, ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_half_a_character_waits_for_its_rest(loaded: LoadedModel) -> None:
    ids = loaded.tokenizer.encode("🤖", add_special_tokens=False)
    assert len(ids) > 1
    detokenizer = Detokenizer(loaded.tokenizer)
    assert [detokenizer.text(ids, end, whole=False) for end in range(1, len(ids) + 1)][-1] == "🤖"
    assert detokenizer.text(ids, len(ids), whole=True) == ""
