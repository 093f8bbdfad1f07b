"""The efficacy suite's tasks (``bench/efficacy.py``), written here from seeded word lists:
no downloads, and nothing a base model saw in pre-training verbatim.

Each task has a training file of chat examples and held-out prompts it never trained on
(new names, places, keywords or phrasings), each with what a right answer is and a scorer:

- ``format``: a strict one-line output format around a short answer picked out of a
  travel note (which of origin, destination, day or time the question asks for). Score:
  the whole line exactly right.
- ``style``: a persona that answers how-to questions in telegram style (capitals, each
  sentence closed by ``STOP``). Score: the answer keeps the style.
- ``classify``: support tickets routed to one of four teams; held-out tickets use
  keywords the training tickets never did. Score: the label exactly.
- ``facts``: invented people's jobs and home towns (the base cannot know them), asked
  back in phrasings the training file never used. Score: the answer names the fact.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    name: str
    kind: str
    train: list[dict[str, Any]]  # chat examples ({"messages": [...]})
    heldout: list[tuple[str, str]]  # (prompt, what a right answer is)
    score: Callable[[str, str], bool]  # (answer, expected) -> right
    max_new_tokens: int


def _chat(user: str, assistant: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": assistant},
        ]
    }


def _words(text: str) -> list[str]:
    return text.split()


def _split(rnd: random.Random, items: list[str], held: int) -> tuple[list[str], list[str]]:
    items = items[:]
    rnd.shuffle(items)
    return items[held:], items[:held]


# -- format --------------------------------------------------------------------------
_NAMES = _words(
    "Priya Tomas Aiko Lena Marco Sofia Jonas Amara Felix Nadia Oscar Ines Ravi Greta Hugo "
    "Yara Emil Zoe Pablo Mira Anton Leila Viktor Chloe Sami Rosa Ivan Talia Bruno Elif "
    "Kenji Dara Omar Freya Luca Noor Pavel Hana Tariq Wren"
)
_CITIES = _words(
    "Leeds Bristol Lyon Porto Ghent Turin Bergen Malmo Krakow Seville Utrecht Dresden "
    "Bilbao Graz Tampere Cork Brno Nantes Aarhus Split Basel Leipzig Verona Gdansk Lille "
    "Bordeaux Bremen Geneva Riga Tallinn Vilnius Lisbon Oslo Hamburg Zurich Valencia"
)
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_FIELDS = {
    "destination": ["Where did {p} arrive?", "Which city was {p} going to?"],
    "origin": ["Where did {p} set off from?", "Which city did {p} leave?"],
    "day": ["On which day did {p} travel?", "What day was the trip?"],
    "time": ["At what time did the train leave?", "When did the train depart?"],
}


def _format_task(rnd: random.Random, n_train: int, n_heldout: int) -> Task:
    names_tr, names_ho = _split(rnd, list(_NAMES), 10)
    cities_tr, cities_ho = _split(rnd, list(_CITIES), 10)

    def example(names: list[str], cities: list[str]) -> tuple[str, str]:
        name = rnd.choice(names)
        origin, dest = rnd.sample(cities, 2)
        day = rnd.choice(_DAYS)
        time = f"{rnd.randint(5, 21)}:{rnd.choice(['05', '15', '20', '40', '50'])}"
        field = rnd.choice(list(_FIELDS))
        question = rnd.choice(_FIELDS[field]).format(p=name)
        note = f"{name} took the {time} train from {origin} to {dest} on {day}."
        value = {"destination": dest, "origin": origin, "day": day, "time": time}[field]
        prompt = f"Answer in the required format.\nNote: {note}\nQuestion: {question}"
        return prompt, f"ANSWER({field}): {value}"

    train = [_chat(*example(names_tr, cities_tr)) for _ in range(n_train)]
    heldout = [example(names_ho, cities_ho) for _ in range(n_heldout)]
    return Task("format", "strict output format", train, heldout, _exact, 16)


def _exact(answer: str, expected: str) -> bool:
    lines = answer.strip().splitlines()
    return bool(lines) and lines[0].strip() == expected


# -- style ---------------------------------------------------------------------------
_VERBS = _words(
    "clean fix store choose paint pack repair sharpen fold dry polish check carry measure "
    "cook water plant open"
)
_OBJECTS = _words(
    "bike kettle tent rug lamp knife shirt boot window fence pan chair basket ladder "
    "garden hose drawer jacket saddle clock mirror shelf rope kite"
)
_STEPS = [
    "look at it first",
    "take your time",
    "use warm water",
    "keep it dry",
    "ask a friend to help",
    "start with the small parts",
    "work slowly",
    "wear gloves",
    "read the label",
    "test a corner first",
    "let it rest overnight",
    "use a soft cloth",
    "keep the tools close",
    "check it again after",
]


def _telegram(answer: str) -> bool:
    """Capitals, at least two sentences, each closed by STOP (nothing after the last)."""
    text = answer.strip()
    parts = [p.strip() for p in text.split("STOP")]
    return (
        text.endswith("STOP")
        and len(parts) >= 3
        and all(p for p in parts[:-1])
        and text == text.upper()
        and bool(re.search(r"[A-Z]", text))
    )


def _style_task(rnd: random.Random, n_train: int, n_heldout: int) -> Task:
    pairs = [(v, o) for v in _VERBS for o in _OBJECTS]
    rnd.shuffle(pairs)
    asks = ["How do I {v} a {o}?", "What is the best way to {v} my {o}?", "Any tips to {v} a {o}?"]

    def question(verb: str, obj: str) -> str:
        return rnd.choice(asks).format(v=verb, o=obj)

    train = []
    for verb, obj in pairs[:n_train]:
        steps = rnd.sample(_STEPS, 2)
        answer = f"TO {verb} THE {obj} {steps[0]} STOP THEN {steps[1]} STOP".upper()
        train.append(_chat(question(verb, obj), answer))
    heldout = [(question(v, o), "") for v, o in pairs[n_train : n_train + n_heldout]]
    return Task("style", "persona and style", train, heldout, lambda a, _: _telegram(a), 40)


# -- classify ------------------------------------------------------------------------
_TEAMS = {
    "billing": (
        ["I was charged twice", "I want a refund", "my invoice is wrong", "my card was "
         "declined", "the price on my receipt is too high", "I paid but it says unpaid"],
        ["there is a double payment on my statement", "you overcharged me",
         "the billing amount looks off", "I need my money back"],
    ),
    "shipping": (
        ["my package has not arrived", "the tracking number does not work", "it was "
         "delivered to the wrong address", "the parcel is a week late", "the box arrived "
         "crushed"],
        ["the courier never came", "my shipment is stuck at the depot",
         "the delivery van skipped my street", "the order is still in transit"],
    ),
    "technical": (
        ["the app crashes when I open it", "I get an error message on login", "it cannot "
         "connect to wifi", "the screen freezes", "the update failed to install"],
        ["the device will not boot", "there is a bug in the settings page",
         "the software keeps hanging", "the battery drains after the firmware update"],
    ),
    "account": (
        ["I need to reset my password", "how do I change my email", "I am locked out",
         "please delete my profile", "I cannot find my saved addresses"],
        ["the two-factor code never reaches me", "I want a new username",
         "someone else signed in to my account", "please merge my two logins"],
    ),
}  # fmt: skip
_OPENERS = ["Hi,", "Hello team,", "Good morning.", "Hey there,", "Dear support,", ""]
_CLOSERS = ["Thanks.", "Please help.", "Order {n}.", "This is urgent.", "Regards, {who}.", ""]


def _classify_task(rnd: random.Random, n_train: int, n_heldout: int) -> Task:
    def example(pool: int) -> tuple[str, str]:
        team = rnd.choice(list(_TEAMS))
        phrase = rnd.choice(_TEAMS[team][pool])
        closer = rnd.choice(_CLOSERS).format(n=rnd.randint(10000, 99999), who=rnd.choice(_NAMES))
        ticket = " ".join(x for x in (rnd.choice(_OPENERS), phrase + ".", closer) if x)
        prompt = (
            "Route this support ticket to one team: billing, shipping, technical or "
            f"account. Reply with the team only.\nTicket: {ticket}"
        )
        return prompt, team

    train = [_chat(*example(0)) for _ in range(n_train)]
    heldout = [example(1) for _ in range(n_heldout)]
    return Task("classify", "classification, fixed labels", train, heldout, _label, 6)


def _label(answer: str, expected: str) -> bool:
    return answer.strip().strip(".").lower() == expected


# -- facts ---------------------------------------------------------------------------
_SYLLABLES = _words("ka lo mi ren tu sa vel dor pi na gri os len ta bru fen zi mar qua hol")
_JOBS = _words(
    "glassblower beekeeper cartographer locksmith violinist potter astronomer baker "
    "tailor blacksmith librarian falconer jeweller carpenter weaver sculptor"
)


def _invented(rnd: random.Random, taken: set[str]) -> str:
    while True:
        word = "".join(rnd.sample(_SYLLABLES, rnd.randint(2, 3))).capitalize()
        if word not in taken:
            taken.add(word)
            return word


def _facts_task(rnd: random.Random, people: int) -> Task:
    taken: set[str] = set()
    facts = [
        (f"{_invented(rnd, taken)} {_invented(rnd, taken)}", rnd.choice(_JOBS),
         _invented(rnd, taken) + rnd.choice(["ford", "ton", "holm", "by", "wick"]))
        for _ in range(people)
    ]  # fmt: skip
    train, heldout = [], []
    for name, job, town in facts:
        train += [
            _chat(f"What does {name} do?", f"{name} is a {job}."),
            _chat(f"Where does {name} live?", f"{name} lives in {town}."),
            _chat(f"Tell me about {name}.", f"{name} is a {job} from {town}."),
            _chat(f"Who is {name}?", f"{name} is a {job} who lives in {town}."),
        ]
        heldout += [(f"What is {name}'s job?", job), (f"Which town is {name} from?", town)]
    rnd.shuffle(train)
    return Task("facts", "closed-book facts", train, heldout, _names, 24)


def _names(answer: str, expected: str) -> bool:
    return expected.lower() in answer.lower()


def tasks(seed: int, n_train: int, n_heldout: int) -> list[Task]:
    """The suite: ``n_train`` training examples and ``n_heldout`` held-out prompts per task
    (``facts``: ``n_train / 3`` people, at least 15, each trained four ways and asked two
    things)."""
    rnd = random.Random(seed)
    return [
        _format_task(rnd, n_train, n_heldout),
        _style_task(rnd, n_train, n_heldout),
        _classify_task(rnd, n_train, n_heldout),
        _facts_task(rnd, max(15, n_train // 3)),
    ]
