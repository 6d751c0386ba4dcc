"""A small generated SQuAD v1.1 pair for smoke runs: ``python -m lightning_simigrad_recipes.data.squad_synthetic DIR``.

Writes ``DIR/train-v1.1.json`` and ``DIR/dev-v1.1.json`` in the official format, nothing downloaded. Every sentence
of a context is a fact ("In 1821, the red fox from Dunmore ate 12 apples.") asked about twice (what was eaten,
when); answers sit at known character offsets, some next to punctuation, one at each context's very end; dev
questions carry several gold answers, as SQuAD's dev set does. Contexts are long enough to be cut into several
windows of a smoke run's 64 tokens. The numbers a smoke run prints on it check the wiring, not a model.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

ADJECTIVES = ["red", "quiet", "old", "tall", "small", "bright", "lazy", "brave", "green", "young"]
ANIMALS = ["fox", "heron", "badger", "otter", "falcon", "beaver", "lynx", "mole"]
PLACES = ["Avonlea", "Brightwater", "Cedar Hill", "Dunmore", "Eastfield", "Fairhaven", "Glenrock"]
FOODS = ["apples", "berries", "clover", "acorns", "fish", "beetles"]


def _paragraph(rng: random.Random, qid: str, sentences: int, dev: bool) -> dict[str, Any]:
    context, qas = "", []
    for s in range(sentences):
        adj, animal, place = rng.choice(ADJECTIVES), rng.choice(ANIMALS), rng.choice(PLACES)
        year, count, food = rng.randint(1700, 1999), rng.randint(2, 99), rng.choice(FOODS)
        sentence = f"In {year}, the {adj} {animal} from {place} ate {count} {food}."
        if context:
            context += " "
        at = len(context)
        context += sentence
        eaten = f"{count} {food}"
        eaten_at = at + sentence.index(eaten)
        year_at = at + sentence.index(str(year))  # followed by a comma
        what = [{"text": eaten, "answer_start": eaten_at}]
        when = [{"text": str(year), "answer_start": year_at}]
        if dev:  # more annotators: other spans of the same answer
            what.append({"text": f"{eaten}.", "answer_start": eaten_at})
            what.append({"text": food, "answer_start": eaten_at + len(str(count)) + 1})
            when.append({"text": f"In {year}", "answer_start": at})
        qas.append({"id": f"{qid}-{s}-what", "question": f"What did the {adj} {animal} eat?", "answers": what})
        # a leading space, as some SQuAD questions have
        qas.append({"id": f"{qid}-{s}-when", "question": f" When did the {animal} from {place} eat?", "answers": when})
    context = context[:-1]  # no final period: the last question's answer ends the context
    for qa in qas:  # the answers that held the final period go
        qa["answers"] = [x for x in qa["answers"] if x["answer_start"] + len(x["text"]) <= len(context)]
    last_word = context.rsplit(" ", 1)[1]
    qas.append(
        {
            "id": f"{qid}-last",
            "question": "What was eaten last?",
            "answers": [{"text": last_word, "answer_start": len(context) - len(last_word)}],
        }
    )
    return {"context": context, "qas": qas}


def make_squad(path: Path, seed: int, articles: int = 3, paragraphs: int = 2, sentences: int = 12) -> Path:
    """Write a SQuAD v1.1 file of ``articles x paragraphs x (2 sentences + 1)`` questions; odd seeds make dev files."""
    rng = random.Random(seed)
    dev = seed % 2 == 1
    data = [
        {
            "title": f"Article_{a}",
            "paragraphs": [_paragraph(rng, f"{seed}-{a}-{p}", sentences, dev) for p in range(paragraphs)],
        }
        for a in range(articles)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": "1.1", "data": data}), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where train-v1.1.json and dev-v1.1.json go")
    parser.add_argument("--articles", type=int, default=3, help="articles per file (2 paragraphs, 25 questions each)")
    args = parser.parse_args(argv)
    for name, seed in (("train-v1.1.json", 0), ("dev-v1.1.json", 1)):
        print(make_squad(args.folder / name, seed=seed, articles=args.articles))


if __name__ == "__main__":
    main()
