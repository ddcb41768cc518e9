"""runtime/chunks.py: prompts cut where their content says, so the same text gives the same chunks
wherever it sits; each new chunk's KV kept as its prompt computed it, found again by the tenant's
later prompts anywhere after their exact head (never the last token's chunk, never another tenant's);
bounded per tenant and in all, the one kept or found longest ago going first."""

from __future__ import annotations

import pytest
import torch

from kvgate.chunk_cache import ChunkStore, chunk_key, fingerprint
from kvgate.runtime.chunks import Breaks, Chunks, cut
from kvgate.runtime.config import ChunkConfig
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.spans import local
from tests.helpers.kv import prefilled

SMALL = ChunkConfig(average=16, minimum=4, maximum=48)  # short texts here span several chunks
NOTES = (
    "The harbour office of Vellmoor opens at seven and closes at dusk. Pilot boats leave from the north "
    "quay, and every manifest is checked twice before a vessel may berth. The ferry to Ostford stops at "
    "night, when the river Ashen runs too fast for the old rope ferry; its keeper, Marten Hale, lives in "
    "the toll house on the east bank and keeps the only key to the chain."
)


def ids_of(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def pieces(ids: list[int], cuts: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *cuts], cuts))


def make(
    loaded: LoadedModel, config: ChunkConfig = SMALL, store: ChunkStore | None = None, breaks: Breaks | None = None
) -> Chunks:
    model_fp, tokenizer_fp = fingerprint("model"), fingerprint("tokenizer")
    return Chunks(
        store or ChunkStore.from_config(),
        loaded.model,
        model_fp,
        lambda ids, scope: chunk_key(model_fp, tokenizer_fp, ids, scope),
        config=config,
        breaks=breaks or Breaks(),
    )


# ---- cutting ----------------------------------------------------------------------------------------


def test_the_same_text_is_cut_the_same_wherever_it_sits(loaded) -> None:
    text = ids_of(loaded, NOTES)
    a = ids_of(loaded, "Summarise these notes for the captain:\n") + text + ids_of(loaded, "\nKeep it short.")
    b = ids_of(loaded, "Question from the writer, who read the researcher's notes below.\n\n") + text
    at_a, at_b = a.index(text[0]), b.index(text[0])
    inside_a = {(s - at_a, e - at_a) for s, e in pieces(a, cut(a, SMALL)) if s >= at_a and e <= at_a + len(text)}
    inside_b = {(s - at_b, e - at_b) for s, e in pieces(b, cut(b, SMALL)) if s >= at_b and e <= at_b + len(text)}
    assert len(inside_a) >= 4
    # Past the text's first cut, its chunks are the same in both prompts.
    first = min(s for s, _ in inside_a | inside_b if s > 0)
    assert {c for c in inside_a if c[0] >= first} == {c for c in inside_b if c[0] >= first}


def test_chunks_are_between_the_minimum_and_the_maximum(loaded) -> None:
    ids = ids_of(loaded, NOTES * 3)
    cuts = cut(ids, SMALL)
    sizes = [e - s for s, e in pieces(ids, cuts)]
    assert cuts == sorted(set(cuts)) and 0 < cuts[-1] <= len(ids)
    assert all(SMALL.minimum <= n <= SMALL.maximum for n in sizes)
    # Content with nothing to cut on is cut at the maximum; a run shorter than the window is not cut.
    assert cut([7] * 200, SMALL) == [48, 96, 144, 192]
    assert cut([1, 2], SMALL) == []


def test_a_blank_line_always_cuts_so_pasted_documents_keep_their_chunks_in_any_order(loaded) -> None:
    tokenizer = loaded.tokenizer
    breaks = Breaks.of(tokenizer)
    paragraphs = [NOTES, NOTES.replace("Vellmoor", "Ostford"), "Short note.", NOTES.replace("seven", "eight")]
    text = "Context:\n\n" + "\n\n".join(paragraphs) + "\n\n\nQuestion: who keeps the key?"
    ids = ids_of(loaded, text)

    def straddling(cuts: list[int]) -> list[str]:
        texts = [tokenizer.decode(ids[s:e]) for s, e in pieces(ids, [*cuts, len(ids)])]
        return [t for t in texts if "\n\n" in t.strip()]  # a blank line inside a chunk

    assert straddling(cut(ids, SMALL, breaks)) == []
    assert straddling(cut(ids, SMALL)) != []  # hashes alone cut where they may


def test_a_long_line_is_cut_before_and_after_whatever_short_line_stands_next_to_it(loaded) -> None:
    """A text that begins a line (an agent's answer quoted after "Context:", a document after its title) keeps
    all its chunks, though the short line before it is closer to the last cut than the minimum."""
    config, breaks, text = (
        ChunkConfig(average=24, minimum=12, maximum=64),
        Breaks.of(loaded.tokenizer),
        ids_of(loaded, NOTES),
    )
    tail = ids_of(loaded, "\nWrite it up.")
    answer = ids_of(loaded, "<|im_start|>assistant\n") + text  # where the notes were first written
    quoted = ids_of(loaded, "Notes below.\nThe researcher said:\n") + text + tail
    assert ids_of(loaded, "\n" + NOTES)[1:] == text  # the notes' first token is the same after a newline

    def within(ids: list[int], at: int) -> list[tuple[int, int]]:
        return [(s - at, e - at) for s, e in pieces(ids, [*cut(ids, config, breaks), len(ids)]) if s >= at]

    in_answer, in_quote = within(answer, len(answer) - len(text)), within(quoted, len(quoted) - len(text) - len(tail))
    assert in_answer[0][0] == 0 and len(in_answer) >= 3
    assert in_quote[: len(in_answer)] == in_answer  # every chunk of the notes, the first one too
    # Short lines are not cut apart: they stay together up to the minimum.
    listing = ids_of(loaded, "".join(f"- item {i}\n" for i in range(30)))
    assert all(e - s >= config.minimum for s, e in pieces(listing, cut(listing, config, breaks)))


@pytest.mark.parametrize("sizes", [(0, 16, 48), (16, 16, 48), (4, 64, 48)])
def test_sizes_that_cannot_hold_are_refused(sizes) -> None:
    minimum, average, maximum = sizes
    with pytest.raises(ValueError, match="chunk sizes"):
        ChunkConfig(average=average, minimum=minimum, maximum=maximum)


# ---- keeping and finding ------------------------------------------------------------------------------


def test_a_chunk_is_kept_as_its_prompt_computed_it_and_found_anywhere_later(loaded) -> None:
    text = ids_of(loaded, NOTES)
    earlier = ids_of(loaded, "Summarise these notes for the captain:\n") + text + ids_of(loaded, "\nBe brief.")
    chunks = make(loaded)
    kv = prefilled(loaded, earlier)
    chunks.keep(kv, earlier, "t")
    assert chunks.count > 0
    # Its KV: the prompt's rows of those tokens, keys moved to positions 0..T-1.
    start, end = pieces(earlier, cut(earlier, SMALL))[2]
    entry = chunks.store.get(chunks.key(earlier[start:end], "t"))
    assert entry is not None and entry.token_ids == tuple(earlier[start:end])
    keys, values = local(loaded.model, kv, start, end - start)
    assert torch.equal(entry.keys, keys) and torch.equal(entry.values, values)

    later = ids_of(loaded, "The writer's draft quotes the notes.\n\n") + text + ids_of(loaded, "\nWho keeps the key?")
    found = chunks.find(later, 0, "t")
    assert [t for p in found.pieces for t in p] == later  # the pieces are the prompt
    reused = [p for p, f in zip(found.pieces, found.found) if f]
    assert found.reused >= len(text) // 2
    assert all(any(p == text[i : i + len(p)] for i in range(len(text))) for p in reused)  # only the notes
    # The last token's chunk is computed, even when a tier holds it: its logits start the answer.
    ends = cut(earlier, SMALL)
    shorter = chunks.find(earlier[: ends[3]], 0, "t")
    assert shorter.found[1:3] == [True, True] and not shorter.found[-1] and len(shorter.pieces) == 4
    # Nothing before the exact head, nothing for another tenant.
    assert not any(chunks.find(later, len(later) - 1, "t").found)
    assert not any(chunks.find(later, 0, "other").found)


def test_what_a_tier_holds_is_not_stored_again_and_the_edge_is_never_kept(loaded) -> None:
    ids = ids_of(loaded, NOTES)
    chunks = make(loaded)
    kv = prefilled(loaded, ids)
    last = chunks.keep(kv, ids, "t")
    assert last == cut(ids, SMALL)[-1]  # up to the last cut: what follows may go on in a longer run
    kept = chunks.count
    assert chunks.keep(kv, ids, "t") == last and chunks.count == kept
    # A longer run (the answer after the prompt) keeps only what lies past where the prompt stopped.
    more = ids + ids_of(loaded, " The toll is two coins, paid at the east bank, and the keeper rings a bell.")
    kv = prefilled(loaded, more)
    assert chunks.keep(kv, more, "t", last) >= last
    assert chunks.count > kept


def test_a_finished_answer_keeps_its_edge_and_is_found_one_token_short(loaded) -> None:
    """An answer ends where it ends: at finish what follows the last cut is kept too, so a later prompt that
    quotes the answer (cut there by the line after it) finds all of it. An answer stopped at its length has
    no KV for its last token: the quote's last chunk is found one token short, that token computed."""
    breaks = Breaks.of(loaded.tokenizer)
    prompt, answer = ids_of(loaded, "Write notes.\n"), ids_of(loaded, NOTES)
    run = prompt + answer
    kv = prefilled(loaded, run[:-1])  # the last sampled token was never fed
    chunks = make(loaded, breaks=breaks)
    edge = cut(run, SMALL, breaks)[-1]
    assert chunks.keep(kv, run, "t") == edge and chunks.key(run[edge:-1], "t") not in chunks.store
    chunks.keep(kv, run, "t", final=True)
    assert chunks.key(run[edge:-1], "t") in chunks.store

    quoted = ids_of(loaded, "Edit the notes below.\n") + answer + ids_of(loaded, "\n\nShorter, please.")
    found = chunks.find(quoted, 0, "t")
    assert [t for p in found.pieces for t in p] == quoted
    reused = [p for p, f in zip(found.pieces, found.found) if f]
    assert sum(map(len, reused)) == len(answer) - 1  # all of the answer but its last token
    assert found.pieces[found.pieces.index(run[edge:-1]) + 1] == answer[-1:]


def test_chunks_are_bounded_per_tenant_and_in_all_the_oldest_going_first(loaded) -> None:
    ids = ids_of(loaded, NOTES * 2)
    kv = prefilled(loaded, ids)
    chunks = make(loaded, ChunkConfig(average=16, minimum=4, maximum=48, per_tenant=3, total=5))
    chunks.keep(kv, ids, "a")
    assert chunks.count == 3 and len(chunks.kept["a"]) == 3
    kept = list(chunks.kept["a"])
    assert all(key in chunks.store for key in kept)
    first = chunks.key(ids[: cut(ids, SMALL)[0]], "a")
    assert first not in chunks.store  # dropped from the index: dropped from the store
    found = chunks.store.get(kept[0])
    assert found is not None and chunks.touch(list(found.token_ids), "a")  # found again: a's newest now
    chunks.keep(kv, ids, "b")
    assert chunks.count == 5 and len(chunks.kept["b"]) == 3 and len(chunks.kept["a"]) == 2
    assert kept[1] not in chunks.store and kept[0] in chunks.store  # a's oldest went first
