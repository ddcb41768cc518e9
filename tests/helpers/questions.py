"""Questions the project writes itself, for the benchmarks' tests (see tests/helpers/corpus.py for the documents):
GSM8K-like word problems (`question`, `answer`: small arithmetic worked in GSM8K's `<<expression=value>>`
notation, ending in `#### value`) and QQP-like question pairs (`a`, `b`, `duplicate` 0/1: paraphrases,
near non-duplicates that make the natural traps, unrelated questions). Seeded and deterministic."""

from __future__ import annotations

import random

# ---- arithmetic word problems -------------------------------------------------------------------

NAMES = "Ilsa Oren Maren Tobin Selka Aldo Brenna Corin Dalia Emmet Fenna Galen Hesper Ivo Jessa Kellan".split()
ITEMS = "apples,marbles,stickers,pencils,shells,stamps,buttons,cards".split(",")


def _problem(rng: random.Random) -> tuple[str, list[tuple[str, int]]]:
    """A question and the worked steps: (expression, value) each, the last one the answer."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randrange(12, 60), rng.randrange(2, 11), rng.randrange(3, 20)
    kind = rng.randrange(6)
    if kind == 0:
        q = (
            f"{name} has {a} {item}. {name} gives {b} of them to {friend} and then buys {c} more at the shop. "
            f"How many {item} does {name} have now?"
        )
        return q, [(f"{a}-{b}", a - b), (f"{a - b}+{c}", a - b + c)]
    if kind == 1:
        price = rng.randrange(2, 9)
        q = (
            f"A baker in {name}'s village bakes {a} loaves every morning and sells each loaf for ${price}. "
            f"One morning {b} loaves are burnt and thrown away. How much money does the baker make that morning "
            "if every other loaf is sold?"
        )
        return q, [(f"{a}-{b}", a - b), (f"{a - b}*{price}", (a - b) * price)]
    if kind == 2:
        days = rng.randrange(3, 8)
        q = (
            f"{name} reads {b} pages of a novel every day for {days} days, and then reads {c} pages on the last "
            "day of the holiday. How many pages did " + f"{name} read in total?"
        )
        return q, [(f"{b}*{days}", b * days), (f"{b * days}+{c}", b * days + c)]
    if kind == 3:
        crates = rng.randrange(3, 9)
        q = (
            f"A crate holds {b} jars of jam. {name} fills {crates} crates completely and still has {c} jars left "
            "over on the table. How many jars of jam did " + f"{name} make?"
        )
        return q, [(f"{b}*{crates}", b * crates), (f"{b * crates}+{c}", b * crates + c)]
    if kind == 4:
        q = (
            f"{name} walks {b} kilometres on Monday and twice as far on Tuesday. On Wednesday {name} walks "
            f"{c} kilometres. How many kilometres does {name} walk over the three days?"
        )
        return q, [(f"{b}*2", 2 * b), (f"{b}+{2 * b}+{c}", 3 * b + c)]
    price, count = rng.randrange(3, 12), rng.randrange(2, 6)
    note = 50 if price * count < 50 else 100
    q = (
        f"A ticket to the river fair costs ${price}. {name} buys {count} tickets for the family and pays with "
        f"a ${note} note. How much change does {name} get back?"
    )
    return q, [(f"{price}*{count}", price * count), (f"{note}-{price * count}", note - price * count)]


def gsm8k_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` word problems as `kvgate bench multiagent` reads them: question, answer ending in `#### value`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, steps = _problem(rng)
        worked = "\n".join(f"{expr} = <<{expr}={value}>>{value}" for expr, value in steps)
        rows.append({"question": question, "answer": f"{worked}\n#### {steps[-1][1]}"})
    return rows


# ---- question pairs -----------------------------------------------------------------------------

TASKS = (
    "learn to play the cello,grow tomatoes on a balcony,train a puppy to sit,improve my handwriting,"
    "prepare for a job interview,learn Python,become a pilot,write a good cover letter,fix a leaking tap,"
    "save money on groceries,fall asleep faster,speak French fluently,start investing in stocks,"
    "bake sourdough bread,paint with watercolours,build a mobile app,memorise a long speech,run a marathon,"
    "stop procrastinating,get a driving licence,learn to swim as an adult,start a small business,"
    "make friends in a new city,keep houseplants alive,lose weight without a diet,learn Java"
).split(",")
HOW = ("How do I {}?", "How can I {}?", "What is the best way to {}?", "What's the easiest way to {}?")
LONG = ("How long does it take to {}?", "How much time do I need to {}?", "How many months does it take to {}?")
COST = ("How much does it cost to {}?", "How expensive is it to {}?", "What does it cost to {}?")
HARD = ("Is it hard to {}?", "How difficult is it to {}?", "Is it difficult to {}?")
PLACES = "Paris,Tokyo,London,Berlin,Toronto,Sydney,Chicago,Boston,Dubai,Seattle,Mumbai,Delhi".split(",")
VISIT = ("What is the best time to visit {}?", "When should I visit {}?", "Which month is best for a trip to {}?")
LIVE = ("Is {} a good place to live?", "What is it like to live in {}?", "Would you recommend living in {}?")
COMPANIES = "Google,Apple,Microsoft,Amazon,Netflix,Samsung,Intel,Oracle,Uber,Tesla".split(",")
JOB = ("How do I get a job at {}?", "How can I get hired by {}?", "What does it take to work at {}?")
PAY = ("How much does {} pay software engineers?", "What is the salary of a software engineer at {}?")
LANGUAGES = "Python,Java,JavaScript,Ruby,Swift,PHP".split(",")
FIRST = ("Is {} good for beginners?", "Should a beginner start with {}?", "Is {} a good first programming language?")
MONTHS = ("Can I {} in {} months?", "Is it possible to {} in {} months?", "Is {1} months enough to {0}?")
MOVE = ("Should I move from {} to {}?", "Is it a good idea to move from {} to {}?", "Is moving from {} to {} worth it?")
PAST = ("What was life like in {} in {}?", "How did people live in {} in {}?", "What was it like to live in {} in {}?")
Subject = tuple[str, ...]
INTENTS: dict[str, tuple[tuple[str, ...], list[Subject]]] = {  # intent: its phrasings, what they are asked about
    "how": (HOW, [(t,) for t in TASKS]),
    "long": (LONG, [(t,) for t in TASKS]),
    "cost": (COST, [(t,) for t in TASKS]),
    "hard": (HARD, [(t,) for t in TASKS]),
    "months": (MONTHS, [(t, str(n)) for t in TASKS[::3] for n in (3, 6)]),
    "visit": (VISIT, [(p,) for p in PLACES]),
    "live": (LIVE, [(p,) for p in PLACES]),
    "move": (MOVE, [(p, q) for p in PLACES[:6] for q in PLACES[:6] if p != q]),
    "past": (PAST, [(p, str(y)) for p in PLACES[::2] for y in (1920, 1975, 2005)]),
    "job": (JOB, [(c,) for c in COMPANIES]),
    "pay": (PAY, [(c,) for c in COMPANIES]),
    "first": (FIRST, [(lang,) for lang in LANGUAGES]),
}
NEIGHBOURS = {"how": ("long", "cost", "hard"), "long": ("how", "cost"), "cost": ("how", "long"), "hard": ("how",)}
NEIGHBOURS |= {"visit": ("live",), "live": ("visit",), "job": ("pay",), "pay": ("job",)}
NEIGHBOURS |= {"months": (), "move": (), "past": (), "first": ()}


def qqp_rows(n: int, seed: int = 0) -> list[dict[str, object]]:
    """`n` pairs as `kvgate bench semantic` reads them (a, b, duplicate 0/1), about 40% duplicates:
    two phrasings of one question; a near non-duplicate (the same subject under a neighbouring intent,
    or the same intent about another subject); or two unrelated questions."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    seen: set[tuple[str, str]] = set()
    while len(rows) < n:
        intent = rng.choice(list(INTENTS))
        forms, subjects = INTENTS[intent]
        subject = rng.choice(subjects)
        a = rng.choice(forms).format(*subject)
        roll = rng.random()
        if roll < 0.4:
            b, duplicate = rng.choice([f for f in forms if f.format(*subject) != a]).format(*subject), 1
        elif roll < 0.6 and NEIGHBOURS[intent]:
            b, duplicate = rng.choice(INTENTS[rng.choice(NEIGHBOURS[intent])][0]).format(*subject), 0
        elif roll < 0.8:
            b, duplicate = rng.choice(forms).format(*rng.choice([s for s in subjects if s != subject])), 0
        else:
            other = rng.choice([i for i in INTENTS if i != intent])
            b, duplicate = rng.choice(INTENTS[other][0]).format(*rng.choice(INTENTS[other][1])), 0
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append({"a": a, "b": b, "duplicate": duplicate})
    return rows
