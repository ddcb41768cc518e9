"""runtime/sequence.py: streamed text never shows part of a stop string or half a character."""

from __future__ import annotations

import torch

from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.sampling import SamplingParams, choose
from kvgate.runtime.sequence import Sequence


def feed(loaded: LoadedModel, text: str, params: SamplingParams) -> tuple[list[str], Sequence]:
    seq = Sequence([1], params, KVCache(1, 1, 1, torch.float32, "cpu"), loaded.eos_token_ids, 10_000)
    pieces = []
    for token in loaded.tokenizer.encode(text, add_special_tokens=False):
        seq.add(token, None, loaded.tokenizer)
        if (out := seq.take_output()) is not None:
            pieces.append(out.text)
        if seq.finish_reason:
            break
    return pieces, seq


def test_stop_string_is_never_streamed(loaded: LoadedModel) -> None:
    pieces, seq = feed(loaded, "alpha beta STOP gamma", SamplingParams(max_tokens=100, stop=("STOP",)))
    assert seq.finish_reason == "stop"
    assert "".join(pieces) == "alpha beta "
    assert not any("ST" in p for p in pieces)


def test_multibyte_characters_arrive_whole(loaded: LoadedModel) -> None:
    text = "emoji 😀 and 日本語"
    pieces, seq = feed(loaded, text, SamplingParams(max_tokens=100))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


class Counting:
    """The tokenizer, counting the tokens each decode is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.longest = tokenizer, 0

    def decode(self, ids, **kwargs) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_text_is_decoded_incrementally_and_equals_the_whole_decode(loaded: LoadedModel) -> None:
    ids = loaded.tokenizer.encode("Once upon a time, 日本語 and 😀 emoji, " * 30, add_special_tokens=False)
    counting = Counting(loaded.tokenizer)
    seq = Sequence(
        [1], SamplingParams(max_tokens=len(ids) - 3), KVCache(1, 1, 1, torch.float32, "cpu"), frozenset(), 10_000
    )
    for token in ids:
        seq.add(token, None, counting)  # type: ignore[arg-type]
        if seq.finish_reason:
            break
    assert seq.text == loaded.tokenizer.decode(ids[: len(ids) - 3])
    assert counting.longest <= 8  # a few tokens a step, not the whole output


def test_length_limit(loaded: LoadedModel) -> None:
    pieces, seq = feed(loaded, "one two three four five six", SamplingParams(max_tokens=3))
    assert seq.finish_reason == "length" and len(seq.output_ids) == 3


def test_kv_capacity_never_exceeds_the_context_window() -> None:
    kv = KVCache(1, 1, 1, torch.float32, "cpu", max_len=20)
    for _ in range(20):
        kv.append(0, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
        assert len(kv.blocks) == 1  # one block: a window of 20 needs no more
    assert len(kv) == 20


def test_a_seed_samples_reproducibly_on_the_kv_device() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU generator cannot sample on a GPU
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(device)
    params = SamplingParams(seed=7)
    runs = []
    for _ in range(2):
        seq = Sequence([1], params, KVCache(1, 1, 1, torch.float32, device), frozenset(), 100)
        runs.append([choose(logits, params, seq.generator) for _ in range(8)])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_its_last_output_says_when_it_was_admitted_got_its_first_token_and_ended(loaded: LoadedModel) -> None:
    seq = Sequence([1], SamplingParams(max_tokens=3), KVCache(1, 1, 1, torch.float32, "cpu"), frozenset(), 10_000)
    seq.admit()
    first, *rest = loaded.tokenizer.encode(" one two three", add_special_tokens=False)[:3]
    seq.add(first, None, loaded.tokenizer)
    sampled = seq.first_token
    outputs = [seq.take_output()]
    for token in rest:
        seq.add(token, None, loaded.tokenizer)
        outputs.append(seq.take_output())
    stages = outputs[-1].stages if outputs[-1] is not None else None
    assert [out.stages for out in outputs[:-1] if out is not None and out.stages] == []  # the last carries them
    assert stages is not None and stages.first_token == sampled  # the first token's time, not a later one's
    assert seq.arrival == stages.arrived <= stages.admitted <= stages.first_token < stages.ended
