"""benchmarks/error_sources.py on a tiny prompt: repairing every document row is exact, naive is not."""

from __future__ import annotations

import torch

from kvgate.bench.error_sources import ALL, NAIVE, alone, analysis, assemble, measure, reference, repair, report, score
from kvgate.runtime.documents import chat_pieces, document_ids
from kvgate.runtime.fidelity import Item, make_reuser
from kvgate.runtime.loader import LoadedModel

PASSAGES = (
    "The Harbour Bridge in Port Elm was built in 1931 by the engineer Mara Lind.",
    "Mara Lind was born in Oslo and later taught at the technical college in Bergen.",
)


def prompt(loaded: LoadedModel, passages: tuple[str, ...]) -> Item:
    tok = loaded.tokenizer
    head, tail = chat_pieces(tok, [{"role": "user", "content": "Where was the bridge's engineer born?"}])
    docs = [document_ids(tok, p) for p in passages]
    return Item([head, *docs, tail], [False, *([True] * len(docs)), False])


def test_repair_all_is_exact_and_naive_is_not(loaded: LoadedModel) -> None:
    reuser = make_reuser(loaded)
    item = prompt(loaded, PASSAGES)
    with torch.inference_mode():
        case = reference(reuser, item, loaded.eos_token_ids)
        naive = assemble(reuser, case, [alone(reuser, d) for d in case.docs])
        exact_kl, exact_top1 = score(reuser, case, repair(case, naive, case.mask()))
        naive_kl, _ = score(reuser, case, naive)
    assert case.answer and case.starts[-1] == len(item.ids) - len(item.pieces[-1])
    assert abs(exact_kl) < 1e-4 and exact_top1 == 1.0
    assert naive_kl > 1e-4  # the second passage's KV never saw the first


def test_every_row_is_scored_and_reported(loaded: LoadedModel) -> None:
    item, other = prompt(loaded, PASSAGES), prompt(loaded, PASSAGES[::-1])
    found = measure(make_reuser(loaded), [item], [other], loaded.eos_token_ids)
    assert abs(found[ALL].mean("kl")) < 1e-4 and found[ALL].mean("top1") == 1.0
    assert found[NAIVE].mean("kl") > 1e-4 and found[NAIVE].share == 0.0
    assert any(name.startswith("oracle 50%") for name in found)
    text = report(found) + analysis(found)
    assert all(name in text for name in found) and "nan" not in text
