"""runtime/retrieval_task.py: the retrieval tasks reuse is scored on are deterministic, well formed and
answerable only from their documents. No model runs here (the tokenizer only)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.retrieval_task import BENCH_SEED, CALIBRATION_SEED, Accuracy, correct, kept, task_item, tasks


def test_the_same_arguments_give_the_same_tasks_and_another_seed_others() -> None:
    assert tasks(8, seed=3, data=None) == tasks(8, seed=3, data=None)
    bench, calibration = tasks(6, BENCH_SEED, data=None), tasks(6, CALIBRATION_SEED, data=None)
    assert {t.question for t in bench}.isdisjoint(t.question for t in calibration)


def test_a_task_holds_its_fact_once_among_reordered_documents_at_every_depth() -> None:
    found = tasks(12, docs=6, words=60, data=None)
    assert [t.needle for t in found] == [n % 6 for n in range(12)]  # the fact at every depth in turn
    for t in found:
        assert len(t.asked) == len(t.stored) == 6 and sorted(t.asked) == sorted(t.stored) and t.asked != t.stored
        name = re.search(r"of (.+)\? Reply", t.question).group(1)
        holding = [i for i, d in enumerate(t.asked) if f"of {name} is " in d]
        assert holding == [t.needle] and f"of {name} is {t.answer}." in t.asked[t.needle]
        assert sum(len(re.findall(r" is \d{4}\.", d)) for d in t.asked) == 3  # the fact and two distractors
        assert t.lead.endswith(f"of {name} is") and all(len(d.split()) >= 60 for d in t.asked)


def test_filler_comes_from_the_data_file_when_there_and_is_made_when_not(tmp_path: Path) -> None:
    rows = [
        {"question": "q", "passages": [f"passage {i} word. " * 30 for i in range(10 * r, 10 * r + 10)]} for r in (0, 1)
    ]
    data = tmp_path / "rag.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_data = tasks(3, docs=4, words=40, data=data)
    assert all(d.split()[0] in ("passage", "The") and "passage" in d for t in from_data for d in t.asked)
    assert tasks(3, docs=4, words=40, data=tmp_path / "missing.jsonl") == tasks(3, docs=4, words=40, data=None)
    assert tasks(2, docs=2, words=40, data=None)[0].asked  # two documents: one distractor


def test_an_answer_is_right_when_its_first_number_is_the_facts() -> None:
    t = tasks(1, data=None)[0]
    assert correct(t, f" {t.answer}.") and correct(t, f"{t.answer[0]},{t.answer[1:]}")
    assert not correct(t, " 12 and then " + t.answer) and not correct(t, "I do not know.")
    full, mode = Accuracy([True, True, False]), Accuracy([True, False, True])
    assert kept(full, mode) == (1, 2) and full.rate == 2 / 3


def test_a_task_is_a_prompt_of_head_documents_and_question_ending_in_the_answer_lead(loaded: LoadedModel) -> None:
    t = tasks(1, docs=3, words=30, data=None)[0]
    item, stored = task_item(loaded.tokenizer, t), task_item(loaded.tokenizer, t, stored=True)
    assert item.documents == [False, True, True, True, False] and len(item.pieces) == 5
    assert loaded.tokenizer.decode(item.pieces[-1]).endswith(t.lead) and t.question in loaded.tokenizer.decode(item.ids)
    assert sorted(map(tuple, item.pieces[1:-1])) == sorted(map(tuple, stored.pieces[1:-1]))
