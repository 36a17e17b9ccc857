"""Seeded synthetic SQuAD: templated facts about a small invented world, in SQuAD v1.1 JSON.

::

    synthetic_squad(num_questions=2000, seed=0, facts_per_paragraph=3,
                    paragraphs_per_article=20, n_countries=24, n_people=40,
                    n_rivers=12) -> dict                         # the SQuAD v1.1 document
    write_synthetic_squad(path, num_questions=2000, seed=0, **kw) -> Path
    synthetic_texts(num_questions=2000, seed=0, **kw) -> list[str]   # for training a BPE

The world (``seed``) has a few invented countries, cities, people and rivers with fixed facts
("The capital of Veloria is Tarnis.", 4 per country, 3 per person, 1 per river: 228 by default).
Each paragraph states ``facts_per_paragraph`` of them; each question asks one ("What is the
capital of Veloria?") and its answer is a span of the paragraph, with the exact ``answer_start``.
Contexts are short, the templates repeat, and a question always has the same answer, so a tiny
model can learn it by copying from the context or by remembering the small world -- the data of
the tiny demo (examples/squad_tiny.yaml: training loss 6.3 -> 0.9 and validation loss on another
seed's world 6.2 -> 2.5 in 120 steps). A smaller world (``n_countries`` ...) is memorised faster;
``facts_per_paragraph=1`` makes copying easier.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from hybridtrain.fileio import atomic_write

from .io import check_count

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr", "st"]
_VOWELS = ["a", "e", "i", "o", "u", "ia", "ou"]
_CODAS = ["", "", "n", "r", "s", "l", "th"]
_PRODUCTS = ["wool", "copper", "tea", "glass", "silk", "salt", "cheese", "timber", "wine", "paper"]
_ANIMALS = ["fox", "heron", "lynx", "otter", "falcon", "badger", "stag", "owl", "wolf", "crane"]
_JOBS = ["baker", "sailor", "painter", "doctor", "farmer", "teacher", "weaver", "miner", "judge"]
_COLORS = ["red", "green", "blue", "white", "black", "yellow", "purple", "orange"]


def _name(rng: random.Random, syllables: int, used: set) -> str:
    while True:
        s = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )
        s = s.capitalize()
        if s not in used:
            used.add(s)
            return s


def _world(seed: int, n_countries: int, n_people: int, n_rivers: int):
    rng = random.Random(seed)
    used: set = set()
    countries = [_name(rng, 2, used) + rng.choice(["ia", "land", "a", "or"]) for _ in range(n_countries)]
    cities = [_name(rng, 2, used) for _ in range(n_countries * 2)]
    facts = []  # (sentence, question, answer)
    for i, c in enumerate(countries):
        cap = cities[2 * i]
        facts.append((f"The capital of {c} is {cap}.", f"What is the capital of {c}?", cap))
        prod = rng.choice(_PRODUCTS)
        facts.append((f"{c} is famous for its {prod}.", f"What is {c} famous for?", prod))
        animal = rng.choice(_ANIMALS)
        facts.append(
            (f"The national animal of {c} is the {animal}.",
             f"What is the national animal of {c}?", animal)
        )
        color = rng.choice(_COLORS)
        facts.append(
            (f"The flag of {c} is {color}.", f"What color is the flag of {c}?", color)
        )
    for _ in range(n_people):
        p = f"{_name(rng, 1, used)} {_name(rng, 2, used)}"
        city = rng.choice(cities)
        year = str(rng.randint(1700, 2010))
        job = rng.choice(_JOBS)
        facts.append((f"{p} was born in {city}.", f"Where was {p} born?", city))
        facts.append((f"{p} was born in {year}.", f"In what year was {p} born?", year))
        facts.append((f"{p} works as a {job}.", f"What is the job of {p}?", job))
    for _ in range(n_rivers):
        r = _name(rng, 2, used)
        city = rng.choice(cities)
        facts.append(
            (f"The river {r} flows through {city}.",
             f"Which city does the river {r} flow through?", city)
        )
    return facts


def synthetic_squad(
    num_questions: int = 2000,
    seed: int = 0,
    facts_per_paragraph: int = 3,
    paragraphs_per_article: int = 20,
    n_countries: int = 24,
    n_people: int = 40,
    n_rivers: int = 12,
) -> dict:
    """A SQuAD v1.1 document with ``num_questions`` answerable questions."""
    if num_questions < 1 or facts_per_paragraph < 1 or paragraphs_per_article < 1:
        raise ValueError("num_questions, facts_per_paragraph and paragraphs_per_article must be >= 1")
    facts = _world(seed, n_countries, n_people, n_rivers)
    if facts_per_paragraph > len(facts):
        raise ValueError(f"facts_per_paragraph={facts_per_paragraph} exceeds the {len(facts)} facts")
    rng = random.Random(seed + 1)
    articles, paragraphs, n = [], [], 0
    while n < num_questions:
        chosen = rng.sample(facts, facts_per_paragraph)
        context, qas, starts = "", [], []
        for sentence, _, _ in chosen:
            if context:
                context += " "
            starts.append(len(context))
            context += sentence
        order = list(range(len(chosen)))
        rng.shuffle(order)
        for k in order[: min(len(chosen), num_questions - n)]:
            sentence, question, answer = chosen[k]
            start = starts[k] + sentence.rindex(answer)
            assert context[start : start + len(answer)] == answer
            qas.append(
                {
                    "id": f"syn-{seed}-{n:07d}",
                    "question": question,
                    "answers": [{"text": answer, "answer_start": start}],
                }
            )
            n += 1
        paragraphs.append({"context": context, "qas": qas})
        if len(paragraphs) == paragraphs_per_article or n >= num_questions:
            articles.append({"title": f"Synthetic_{len(articles)}", "paragraphs": paragraphs})
            paragraphs = []
    return {"version": "1.1", "data": articles}


def write_synthetic_squad(path: str | os.PathLike, num_questions: int = 2000, seed: int = 0,
                          **kwargs) -> Path:
    """Write :func:`synthetic_squad` as JSON to ``path``; returns the path. Safe when every
    rank calls it at once (a file that already holds the document is not rewritten)."""
    path = Path(path)
    check_count(num_questions, "write_synthetic_squad num_questions")
    doc = synthetic_squad(num_questions, seed, **kwargs)
    atomic_write(path, json.dumps(doc, ensure_ascii=False))
    return path


def synthetic_texts(num_questions: int = 2000, seed: int = 0, **kwargs) -> list[str]:
    """Contexts and questions of :func:`synthetic_squad`, e.g. to train the demo tokenizer on."""
    out = []
    for art in synthetic_squad(num_questions, seed, **kwargs)["data"]:
        for par in art["paragraphs"]:
            out.append(par["context"])
            out.extend(qa["question"] for qa in par["qas"])
    return out
