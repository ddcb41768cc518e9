"""Evaluation text the project writes itself, so that the benchmarks' tests run from the repository alone.

Seeded and deterministic: the same rows on every machine, each set in the format its benchmark reads
(`--data`):

- MuSiQue-like RAG items (`id`, `question`, `answers`, 10 `passages`): passages about fictional towns,
  people and colleges with checkable facts ("Vellmoor lies on the river Ashen; its mayor is ..."), and a
  two-hop question over two of them; the other eight passages are distractors about other entities.
- GSM8K-like word problems and QQP-like question pairs: tests/helpers/questions.py (written out by `write_jsonl`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# ---- the fictional world ------------------------------------------------------------------------

STEMS = (
    "vell ash dun mar cor bry tal wen hal ost fen gar lin rov sel kest ald bram quen tor isk mel orn pell sab "
    "ulm yar zel dro hev cair lom nes fal wyr tam brin hol esk grim"
).split()
TOWN_ENDS = "moor ford wick haven stead mere holt by ton dale crest well gate bury".split()
RIVER_ENDS = "en a el ine oss ar ith une".split()
FIRST_ENDS = "a o en is ric wyn ette an ia et".split()
SURNAMES = (
    "Narrow Quill Thatch Ember Hollin Brackwater Stillman Oakhart Fallow Greaves Kettle Ravel Sorrel Wickham "
    "Larkspur Ashdown Merrow Tallis Vane Corliss Dunmore Penhallow Saltmarsh Fenn Rook Harrowgate Bellweather "
    "Crane Moss Thistle"
).split()
TRADES = "salt,wool,glass,clocks,rope,paper,cheese,copper,lanterns,barrels,honey,slate".split(",")
PROFESSIONS = (
    "cartographer,clockmaker,botanist,glassblower,historian,shipwright,astronomer,physician,composer,"
    "bookbinder,architect,weaver"
).split(",")
SUBJECTS = "navigation,medicine,music,law,engineering,botany,astronomy,painting".split(",")
LANDMARKS = (
    "the Glass Bridge,the Old Lantern Tower,the Salt Steps,the Weavers' Hall,the Copper Fountain,the Grey Mill,"
    "the Long Arcade,the Bell Orchard,the Stone Ferry,the Moon Gate"
).split(",")
BOOK_NOUNS = "Lantern,Orchard,Compass,Harbour,Winter,Ferry,Clock,Meadow,Tide,Bridge,Archive,Garden".split(",")
BOOK_FORMS = ("The {} Road", "A History of the {}", "The Last {}", "Letters from the {}", "Under the {}")
ADJECTIVES = "quiet,narrow,crowded,windy,green,old,steep,bright,famous,crooked".split(",")
THINGS = "market square,harbour wall,lanes,gardens,bridges,rooftops,river bank,chapel,library,inns".split(",")

TOWN_FILLER = (
    "Visitors often remark on its {adj} {thing} and on the smell of the river in the morning.",
    "Most of its houses are built of pale stone carried down from the hills to the north.",
    "In winter the {thing} are {adj}, and the ferries stop running for several weeks.",
    "A weekly market fills the square every Thursday, when farmers come in from the valley.",
    "The town keeps a small museum of maps, tools and letters from its earliest families.",
    "Its children learn to swim in the shallows below the old weir before they can read.",
    "Local cooks are known for a thick fish stew flavoured with smoked pepper and thyme.",
    "A narrow-gauge railway once linked it to the coast, and its station is now a tea room.",
    "The council meets in a timber hall whose roof was rebuilt after a fire two centuries ago.",
    "Travellers describe the {thing} as the most {adj} in the whole province.",
    "Its bell ringers still follow a pattern of peals written down by the first settlers.",
    "On clear nights the lights of the neighbouring villages can be seen from the hill above it.",
    "The town's football club has never won the provincial cup, though it reached the final twice.",
    "Each spring the streets are swept and the doors painted before the river festival.",
)
PERSON_FILLER = (
    "Friends described {them} as patient, stubborn and fond of long walks before breakfast.",
    "{They} kept detailed notebooks, many of which are now held in a provincial archive.",
    "In later life {they} travelled widely, though {they} always returned home for the harvest.",
    "{They} corresponded with scholars in several countries and answered every letter by hand.",
    "A portrait of {them} hangs in the reading room of the town library.",
    "{They} refused several honours, saying that the work mattered more than the name.",
    "Colleagues remembered {their} habit of working late by the light of a single lamp.",
    "{They} taught a small circle of apprentices, three of whom became well known in their own right.",
    "Late in life {they} gave most of {their} savings to a school for orphaned children.",
    "{They} enjoyed sailing and owned a small boat that {they} repaired every spring.",
    "Several of {their} early works were lost in a flood and are known only from descriptions.",
    "Critics were divided about {their} methods, but few doubted {their} skill.",
)
COLLEGE_FILLER = (
    "Its library holds more than forty thousand volumes, many of them donated by former students.",
    "Students wear grey gowns on formal days and eat together in a long vaulted hall.",
    "The college admits about two hundred students a year after a written examination.",
    "Its gardens run down to the water and are open to the public on summer evenings.",
    "A rowing race against a rival college is held every spring and draws large crowds.",
    "The oldest building has a clock tower whose bell can be heard across the town.",
    "Teaching is organised in small groups, and each student meets a tutor every week.",
    "Several of its graduates went on to found colleges of their own in distant provinces.",
    "Its archive keeps the admission registers of every student since the first year.",
    "The college was nearly closed during a long economic crisis but was saved by a public appeal.",
)


@dataclass
class Town:
    name: str
    river: str
    founded: int
    population: int
    trade: str
    landmark: str
    mayor: int = -1  # a person
    neighbour: int = -1  # a town


@dataclass
class Person:
    name: str
    pronoun: str  # "she" or "he"
    born: int  # a town
    profession: str
    college: int
    book: str


@dataclass
class College:
    name: str
    town: int
    founded: int
    subject: str


@dataclass
class World:
    towns: list[Town]
    people: list[Person]
    colleges: list[College]


def _unique(make: Callable[[], str], taken: set[str]) -> str:
    while True:
        name = make()
        if name not in taken:
            taken.add(name)
            return name


def make_world(seed: int = 0, towns: int = 30, people: int = 40, colleges: int = 10) -> World:
    """Fictional towns, people and colleges; every name is made up from syllables and unique."""
    rng = random.Random(seed)
    taken: set[str] = set()

    def town_name() -> str:
        return rng.choice(STEMS).capitalize() + rng.choice(TOWN_ENDS)

    def river_name() -> str:
        return rng.choice(STEMS).capitalize() + rng.choice(RIVER_ENDS)

    def person_name() -> str:
        return f"{rng.choice(STEMS).capitalize()}{rng.choice(FIRST_ENDS)} {rng.choice(SURNAMES)}"

    def book_title() -> str:
        return rng.choice(BOOK_FORMS).format(rng.choice(BOOK_NOUNS))

    world = World(
        towns=[
            Town(
                name=_unique(town_name, taken),
                river=_unique(river_name, taken),
                founded=rng.randrange(1150, 1890),
                population=rng.randrange(8, 900) * 100,
                trade=rng.choice(TRADES),
                landmark=rng.choice(LANDMARKS),
            )
            for _ in range(towns)
        ],
        people=[],
        colleges=[],
    )
    while len(world.colleges) < colleges:
        town, subject = rng.randrange(towns), rng.choice(SUBJECTS)
        name = f"the {world.towns[town].name} College of {subject.capitalize()}"
        if name not in taken:
            taken.add(name)
            world.colleges.append(College(name, town, rng.randrange(1300, 1900), subject))
    for _ in range(people):
        world.people.append(
            Person(
                name=_unique(person_name, taken),
                pronoun=rng.choice(("she", "he")),
                born=rng.randrange(towns),
                profession=rng.choice(PROFESSIONS),
                college=rng.randrange(colleges),
                book=_unique(book_title, taken),
            )
        )
    mayors = rng.sample(range(people), towns) if people >= towns else [rng.randrange(people) for _ in range(towns)]
    for i, town in enumerate(world.towns):
        town.mayor = mayors[i]
        town.neighbour = rng.choice([j for j in range(towns) if j != i])
    return world


def _fill(rng: random.Random, facts: list[str], filler: tuple[str, ...], words: int, **names: str) -> str:
    """The facts first (a passage cut to its first words keeps them), then filler up to about `words`."""
    out = list(facts)
    for sentence in rng.sample(filler, len(filler)):
        if sum(len(s.split()) for s in out) >= words:
            break
        text = sentence.format(adj=rng.choice(ADJECTIVES), thing=rng.choice(THINGS), **names)
        out.append(text[0].upper() + text[1:])
    return " ".join(out)


def town_passage(world: World, i: int, rng: random.Random) -> str:
    t = world.towns[i]
    facts = [
        f"{t.name} is a town on the river {t.river}.",
        f"It was founded in {t.founded} and has a population of about {t.population:,}.",
        f"Its mayor is {world.people[t.mayor].name}, and its main trade is {t.trade}.",
        f"The best known building in {t.name} is {t.landmark}.",
        f"Its nearest neighbour is {world.towns[t.neighbour].name}, half a day's walk downstream.",
    ]
    return _fill(rng, facts, TOWN_FILLER, rng.randrange(170, 260))


def person_passage(world: World, i: int, rng: random.Random) -> str:
    p = world.people[i]
    they, their, them = p.pronoun, *(("her", "her") if p.pronoun == "she" else ("his", "him"))
    facts = [
        f"{p.name} is a {p.profession} born in {world.towns[p.born].name}.",
        f"{they.capitalize()} studied at {world.colleges[p.college].name}.",
        f"{they.capitalize()} is best known as the author of {p.book}, a book about {their} travels.",
    ]
    words = rng.randrange(150, 230)
    return _fill(rng, facts, PERSON_FILLER, words, they=they, They=they.capitalize(), their=their, them=them)


def college_passage(world: World, i: int, rng: random.Random) -> str:
    c = world.colleges[i]
    facts = [
        f"{c.name[0].upper() + c.name[1:]} stands in the town of {world.towns[c.town].name}.",
        f"It was founded in {c.founded} and is known for teaching {c.subject}.",
    ]
    return _fill(rng, facts, COLLEGE_FILLER, rng.randrange(150, 220))


def two_hop(world: World, rng: random.Random) -> tuple[str, str, list[tuple[str, int]]]:
    """A question, its answer and the two passages (kind, index) that answer it together."""
    p = rng.randrange(len(world.people))
    person = world.people[p]
    home = world.towns[person.born]
    college = world.colleges[person.college]
    mayor_of = [i for i, t in enumerate(world.towns) if t.mayor == p]
    kind = rng.randrange(5 if mayor_of else 4)
    if kind == 0:
        return (
            f"Which river flows through the town where {person.name} was born?",
            home.river,
            [
                ("person", p),
                ("town", person.born),
            ],
        )
    if kind == 1:
        return (
            f"Who is the mayor of the birthplace of the author of {person.book}?",
            world.people[home.mayor].name,
            [
                ("person", p),
                ("town", person.born),
            ],
        )
    if kind == 2:
        return (
            f"In what year was the hometown of {person.name} founded?",
            str(home.founded),
            [
                ("person", p),
                ("town", person.born),
            ],
        )
    if kind == 3:
        return (
            f"In which town is the college where the author of {person.book} studied?",
            (world.towns[college.town].name),
            [("person", p), ("college", person.college)],
        )
    town = mayor_of[0]
    return (
        f"What is the main trade of the town whose mayor wrote {person.book}?",
        world.towns[town].trade,
        [
            ("person", p),
            ("town", town),
        ],
    )


def musique_rows(n: int, seed: int = 0, passages: int = 10) -> list[dict[str, object]]:
    """`n` RAG items as `kvgate bench fidelity` reads them: id, question, answers, `passages` passages
    (the two that answer the question among distractors, in a seeded order)."""
    world, rng = make_world(seed), random.Random(seed + 1)
    writers = {"town": town_passage, "person": person_passage, "college": college_passage}
    sizes = {"town": len(world.towns), "person": len(world.people), "college": len(world.colleges)}
    rows: list[dict[str, object]] = []
    for i in range(n):
        question, answer, support = two_hop(world, rng)
        chosen = list(support)
        while len(chosen) < passages:
            kind = rng.choice(("town", "town", "person", "person", "college"))
            pick = (kind, rng.randrange(sizes[kind]))
            if pick not in chosen:
                chosen.append(pick)
        rng.shuffle(chosen)
        texts = [writers[kind](world, index, random.Random(f"{seed}-{kind}-{index}")) for kind, index in chosen]
        rows.append({"id": f"corpus-{i:03d}", "question": question, "answers": [answer], "passages": texts})
    return rows


def write_jsonl(path: Path, rows: Iterable[dict[str, object]]) -> Path:
    """One JSON object per line, as the benchmarks read them; `path` back."""
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path
