"""QA loaders for the offline evaluation data: FanOutQA single-hop sub-questions, country capitals, and the papers'
open-domain benchmarks (NQ, TriviaQA, WebQuestions, SQuAD) from the ``pyserini==0.16.0`` package.

Benchmarks are named ``NAME[:SPLIT[:SUBSET]]`` (``nq``, ``nq:dev``, ``triviaqa:test:balanced``), see
:func:`parse_benchmark` and :func:`load_benchmark`. The subset splits a benchmark by whether the default corpus can
answer each question (:func:`corpus_answerability`)."""

from __future__ import annotations

import ast
import csv
import hashlib
import importlib.util
import json
import math
import os
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from fastgate.assets import pins
from fastgate.assets.corpus import iter_jsonl_objects
from fastgate.errors import CorpusError, InputError, MissingDependencyError, UnknownNameError

__all__ = [
    "ANSWERABILITY_DEPTH",
    "BENCHMARKS",
    "READ_DEPTH",
    "READ_WORDS",
    "shows_answer",
    "Ranks",
    "SUBSETS",
    "BenchmarkSpec",
    "QAExample",
    "benchmark_questions",
    "corpus_answerability",
    "country_capitals",
    "fanoutqa_subquestions",
    "is_held_out",
    "is_benchmark",
    "load_fit_examples",
    "load_benchmark",
    "load_examples",
    "load_qa",
    "parse_benchmark",
    "refuse_test_split",
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
        raise CorpusError(f"this dataset needs the package {pip_name}: {pins.install_hint(pins.pinned(pip_name))}")
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
    (the 20% of ``default`` that training never sees, :func:`is_held_out`; what evaluations report on), and the
    benchmarks ``nq``, ``triviaqa``, ``webq``, ``squad`` as ``NAME[:SPLIT[:SUBSET]]`` (:func:`load_benchmark`, seed 0).
    """
    name = str(data)
    if is_benchmark(name):
        return load_benchmark(name)
    if name == "heldout":
        return split_examples(country_capitals() + fanoutqa_subquestions())[1]
    if name == "capitals":
        return country_capitals()
    if name == "fanoutqa":
        return fanoutqa_subquestions()
    if name == "default":
        return country_capitals() + fanoutqa_subquestions()
    path = Path(name)
    if not path.is_file() and (name.endswith(".jsonl") or "/" in name) and not path.exists():
        raise CorpusError(f"--data {name}: no such file")  # meant as a file: a typo in it was left to be guessed
    if not path.is_file():
        raise CorpusError(f"--data {name!r} is neither a built-in set ({', '.join(QA_SETS)}), a benchmark "
                          f"({', '.join(BENCHMARKS)}, as NAME[:SPLIT[:SUBSET]]) nor a JSONL file")
    out, lines = [], {}
    for n, row in iter_jsonl_objects(path, "question, answers"):
        question, answers = row.get("question"), row.get("answers")
        if not isinstance(question, str) or not question.strip() or not isinstance(answers, list) or not answers:
            raise CorpusError(f"{path}:{n}: question must be a non-empty string and answers a non-empty list")
        for a in answers:  # "" or null: a gold no answer can match ("" was scored as matching nothing, null as "None")
            number = isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)
            if not (number or isinstance(a, str) and a.strip()):
                got = json.dumps(a, ensure_ascii=False)
                raise CorpusError(f"{path}:{n}: every gold answer must be a non-empty string (or a number), got {got}")
        answers = [a if isinstance(a, str) else str(a) for a in answers]  # 1945 is the answer "1945"
        qid = row.get("id")
        qid = f"{path.stem}-{n}" if qid is None else str(qid)
        if qid in lines:  # records are keyed by id: one would stand for both (scored and resumed as one)
            raise CorpusError(f"{path}:{n}: id {qid!r} is also line {lines[qid]}'s; ids must be unique")
        lines[qid] = n
        out.append(QAExample(qid, question.strip(), tuple(answers), source=path.stem))
    if not out:
        raise CorpusError(f"{path} has no questions")
    return out


def sample_examples(examples: list[QAExample], n: int | None, seed: int = 0) -> list[QAExample]:
    """``n`` examples in a seeded random order (all when ``n`` is None), so small runs mix the sources; the first
    ``n`` of a larger draw with the same seed are the same questions."""
    import random

    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InputError(f"the number of questions must be a positive integer, got {n!r}")  # [:-5]: all but five
    order = list(examples)
    random.Random(seed).shuffle(order)
    return order if n is None else order[:n]


# --- the papers' open-domain QA benchmarks -------------------------------------------------------------------------

PYSERINI_HINT = f"pip install --no-deps {pins.pinned('pyserini')} (newer versions no longer ship the DPR topics)"


@dataclass(frozen=True)
class BenchmarkInfo:
    """Where a benchmark's questions live in Anserini's jar: ``topics-and-qrels/topics.dpr.<stem>.<split>.txt``."""

    name: str
    stem: str
    splits: tuple[str, ...]  # the splits the pyserini 0.16.0 jar carries
    description: str


BENCHMARKS: dict[str, BenchmarkInfo] = {
    "nq": BenchmarkInfo("nq", "nq", ("test", "dev"),
                        "Natural Questions (DPR open-domain split: 3,610 test, 8,757 dev)"),
    "triviaqa": BenchmarkInfo("triviaqa", "trivia", ("test", "dev"),
                              "TriviaQA (DPR open-domain split: 11,313 test, 8,837 dev)"),
    "webq": BenchmarkInfo("webq", "wq", ("test",), "WebQuestions (2,032 test; the jar has no dev split)"),
    "squad": BenchmarkInfo("squad", "squad", ("test",), "SQuAD v1.1 dev as open-domain test (10,570; no dev split)"),
}
SUBSETS = ("all", "answerable", "unanswerable", "balanced")
# A question is *answerable* when the passages the methods read show a gold answer: it occurs as a whole word sequence
# (after SQuAD normalisation) in the title or first READ_WORDS words of one of the BM25 top-READ_DEPTH passages (the
# methods' k and passage_words). It is *unanswerable* when no passage of the BM25 top-ANSWERABILITY_DEPTH holds it
# anywhere. Questions between the two (a gold answer deeper, or cut off) are in neither half. Rule version 1 called
# every gold answer in the top 20 answerable: most of those the methods never read (docs/RESULTS.md). Bump
# _SPLIT_VERSION when the rule changes: it keys the on-disk cache.
ANSWERABILITY_DEPTH = 20
READ_DEPTH = 3
READ_WORDS = 120
_SPLIT_VERSION = 2


@dataclass(frozen=True)
class BenchmarkSpec:
    """``NAME[:SPLIT[:SUBSET]]``: a benchmark, its split (``test`` or ``dev``) and a corpus subset."""

    name: str
    split: str = "test"
    subset: str = "all"

    def __str__(self) -> str:
        return f"{self.name}:{self.split}:{self.subset}"


def is_benchmark(data: str | Path) -> bool:
    """Whether ``data`` names a benchmark (``nq``, ``triviaqa:dev``, ...) rather than a built-in set or a file."""
    return str(data).split(":", 1)[0] in BENCHMARKS and not Path(str(data)).is_file()


def refuse_test_split(data: str | Path, what: str) -> None:
    """Raise unless ``data`` may be fitted on: training and calibration never see a question that is reported on (a
    benchmark's ``test`` split, also what a bare ``nq`` means, or ``heldout``).

    Raises:
        InputError: ``data`` is a test split.
    """
    name = str(data)
    if name == "heldout":
        raise InputError(f"{what} refuses --data heldout: it is the split evaluations report on (use default, "
                         "capitals or fanoutqa, whose held-out fifth training leaves out, or a benchmark's dev split)")
    if is_benchmark(name):
        spec = parse_benchmark(name)
        if spec.split == "test":
            dev = [s for s in BENCHMARKS[spec.name].splits if s != "test"]
            hint = (f"use {spec.name}:{dev[0]}" + (f":{spec.subset}" if spec.subset != "all" else "")
                    if dev else f"{spec.name} has no dev split: use another benchmark's dev split or a JSONL file")
            raise InputError(f"{what} refuses --data {name}: that is {spec.name}'s test split, which results are "
                             f"reported on ({hint})")


def load_examples(data: str | Path, n: int | None, seed: int = 0, index: str | Path | None = None,
                  split: str | None = None, subset: str | None = None, *,
                  progress: bool = True) -> tuple[str, list[QAExample]]:
    """The questions of ``data`` and its canonical name (what records and settings store): a benchmark
    (``NAME[:SPLIT[:SUBSET]]``, in its loader's own seeded order, so a balanced prefix stays balanced) or a built-in
    set or JSONL file (``n`` sampled with ``seed``). ``progress``: the corpus split's progress bar (a benchmark's
    subset computed for the first time).

    Raises:
        InputError: ``split`` / ``subset`` for data that is not a benchmark.
    """
    data = str(data)
    if is_benchmark(data):
        parts = data.split(":")
        for i, (flag, given) in enumerate((("--split", split), ("--subset", subset)), 1):
            if given and len(parts) > i and parts[i] and parts[i] != given:  # nq:test --split dev: one was ignored
                raise InputError(f"{data!r} names {flag.removeprefix('--')} {parts[i]!r} and {flag} says "
                                 f"{given!r}: give one")
        spec = parse_benchmark(data, split, subset)
        return str(spec), load_benchmark(spec, seed=seed, n=n, index=index, progress=progress)
    if split is not None or subset is not None:
        raise InputError("--split and --subset apply to the benchmarks (nq, triviaqa, webq, squad)")
    return data, sample_examples(load_qa(data), n, seed)


def load_fit_examples(data: str | Path, n: int | None, what: str, seed: int = 0,
                      index: str | Path | None = None) -> tuple[str, list[QAExample]]:
    """:func:`load_examples` for fitting (``fastgate train read``, ``fastgate calibrate``; ``what`` names it in
    errors): a test split is refused (:func:`refuse_test_split`) and a built-in set loses its held-out fifth
    (:func:`is_held_out`, ``heldout``: what evaluations report on) before ``n`` are sampled.

    Raises:
        InputError: a test split, or what :func:`load_examples` refuses."""
    refuse_test_split(data, what)
    name = str(data)
    if name in QA_SETS and not Path(name).is_file():
        return name, sample_examples(split_examples(load_qa(name))[0], n, seed)
    return load_examples(data, n, seed, index)


def parse_benchmark(data: str, split: str | None = None, subset: str | None = None) -> BenchmarkSpec:
    """Parse ``NAME[:SPLIT[:SUBSET]]``; ``split`` / ``subset`` fill the parts the string leaves out.

    Raises:
        UnknownNameError: an unknown benchmark, split or subset.
    """
    parts = str(data).split(":")
    if len(parts) > 3:
        raise InputError(f"a benchmark is NAME[:SPLIT[:SUBSET]], got {data!r}")
    name = parts[0]
    if name not in BENCHMARKS:
        raise UnknownNameError("benchmark", name, list(BENCHMARKS))
    info = BENCHMARKS[name]
    split = parts[1] if len(parts) > 1 and parts[1] else (split or "test")
    subset = parts[2] if len(parts) > 2 and parts[2] else (subset or "all")
    if split not in info.splits:
        raise UnknownNameError(f"split of {name}", split, info.splits)
    if subset not in SUBSETS:
        raise UnknownNameError("subset", subset, SUBSETS)
    return BenchmarkSpec(name, split, subset)


def _anserini_jar() -> Path:
    spec = importlib.util.find_spec("pyserini")  # never import pyserini: it starts a JVM
    if spec is None or spec.origin is None:
        raise MissingDependencyError("pyserini", f"{pins.install_hint(pins.pinned('pyserini'))}; newer versions no "
                                                 "longer ship the DPR topics")
    jars = sorted((Path(spec.origin).parent / "resources" / "jars").glob("anserini-*-fatjar.jar"))
    if not jars:
        raise CorpusError(f"pyserini is installed but has no anserini-*-fatjar.jar; {PYSERINI_HINT}")
    return jars[-1]


def _unquote(field: str) -> str:
    """Undo CSV quoting (``"a ""b"" c"`` -> ``a "b" c``); TriviaQA's file quotes some fields twice."""
    while len(field) >= 2 and field[0] == '"' and field[-1] == '"':
        field = next(csv.reader([field]))[0]
    return field


def _parse_topic_line(line: str, where: str) -> tuple[str, tuple[str, ...]]:
    """One line of a DPR topics file: JSON ``{"question", "answer": [...]}`` (WQ, SQuAD) or TSV
    ``question<TAB>['answer', ...]`` (NQ, TriviaQA; the list is a Python literal, fields with quotes CSV-quoted)."""
    if line.startswith("{"):
        try:
            row = json.loads(line)
            question, answers = row["question"], row["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CorpusError(f"{where}: not a JSON topic ({exc})") from None
    else:
        question, tab, rest = line.rpartition("\t")
        if not tab:
            raise CorpusError(f"{where}: expected question<TAB>[answers]")
        question = _unquote(question)
        try:
            answers = ast.literal_eval(_unquote(rest.strip()))
        except (ValueError, SyntaxError) as exc:
            raise CorpusError(f"{where}: the answers are not a list literal ({exc})") from None
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(question, str) or not question.strip() or not isinstance(answers, list):
        raise CorpusError(f"{where}: question must be a non-empty string and answers a list")
    golds = tuple(dict.fromkeys(_unquote(str(a).strip()).strip() for a in answers if str(a).strip()))
    golds = tuple(g for g in golds if g)
    if not golds:
        raise CorpusError(f"{where}: no gold answer")
    return question.strip(), golds


def benchmark_questions(name: str, split: str = "test", jar: str | Path | None = None) -> list[QAExample]:
    """All questions of a benchmark split in file order, ids ``<name>-<split>-<line>`` (1-based).

    Args:
        name: ``nq``, ``triviaqa``, ``webq`` or ``squad``.
        split: ``test``, or ``dev`` for NQ and TriviaQA (for calibration and training, never reported).
        jar: Anserini's fat jar (default: the one in the installed pyserini 0.16.0).

    Raises:
        MissingDependencyError: pyserini is not installed (with the install command).
        UnknownNameError: an unknown benchmark or split.
        CorpusError: the jar lacks the topics file or a line is malformed (named with its line).
    """
    spec = parse_benchmark(name, split)
    info = BENCHMARKS[spec.name]
    jar_path = Path(jar) if jar is not None else _anserini_jar()
    member = f"topics-and-qrels/topics.dpr.{info.stem}.{spec.split}.txt"
    try:
        with zipfile.ZipFile(jar_path) as z:
            raw = z.read(member)
    except KeyError:
        raise CorpusError(f"{jar_path} has no {member}; {PYSERINI_HINT}") from None
    except (OSError, zipfile.BadZipFile) as exc:
        raise CorpusError(f"cannot read {jar_path}: {exc}; reinstall: {PYSERINI_HINT}") from None
    out = []
    # split on newlines only: str.splitlines would also break questions at U+0085 / U+2028 inside them
    for n, line in enumerate(raw.decode("utf-8").split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        question, golds = _parse_topic_line(line, f"{jar_path.name}:{member}:{n}")
        out.append(QAExample(f"{spec.name}-{spec.split}-{n}", question, golds, source=spec.name))
    if not out:
        raise CorpusError(f"{jar_path}:{member} is empty")
    return out


def _contains_answer(text: str, golds: tuple[str, ...]) -> bool:
    from fastgate.eval.metrics import normalize_answer

    padded = f" {normalize_answer(text)} "
    return any(g and f" {g} " in padded for g in (normalize_answer(x) for x in golds))


def shows_answer(hit, words: int, golds) -> bool:
    """Whether ``hit``'s title and first ``words`` words (what a prompt shows) hold one of ``golds`` as a whole word
    sequence after SQuAD normalisation: the benchmarks' "answerable" test for one passage."""
    from fastgate.prompts import passage_text

    return _contains_answer(passage_text(hit, words), tuple(golds))


class Ranks(NamedTuple):
    """Where a question's gold answer is in its BM25 passages (1-based ranks, None: not in the searched depth)."""

    found: int | None  # the first passage whose title or text holds a gold answer
    shown: int | None  # the first passage whose title and first READ_WORDS words (what a prompt shows) hold one

    @property
    def answerable(self) -> bool:
        """The passages the methods read (the top READ_DEPTH, as prompts show them) hold a gold answer."""
        return self.shown is not None and self.shown <= READ_DEPTH

    @property
    def unanswerable(self) -> bool:
        """No searched passage holds a gold answer."""
        return self.found is None


def corpus_answerability(examples: list[QAExample], retriever, *, depth: int = ANSWERABILITY_DEPTH,
                         cache: str | Path | None = None, progress: bool = True) -> dict[str, Ranks]:
    """For each question, where a gold answer first occurs in the ``depth`` passages BM25 returns for it.

    A gold answer counts when it occurs as a whole word sequence after SQuAD normalisation (lower case, no punctuation
    or articles): ``found`` in a passage's title or text, ``shown`` in its title or first READ_WORDS words (the
    prompts' cut, :func:`fastgate.prompts.passage_text`). Deterministic for a given index; the ranks are cached in
    ``cache`` (a JSON file, written atomically) so later runs cost nothing.
    """
    ranks: dict[str, Ranks] = {}
    cache_path = Path(cache) if cache is not None else None
    if cache_path is not None and cache_path.is_file():
        try:
            stored = json.loads(cache_path.read_text())
            if stored.get("depth") == depth and stored.get("version") == _SPLIT_VERSION:
                ranks = {k: Ranks(*v) for k, v in stored["ranks"].items()}
        except (OSError, ValueError, KeyError, AttributeError, TypeError):  # ValueError: not JSON, not UTF-8
            ranks = {}  # a corrupt cache is recomputed
    todo = [e for e in examples if e.id not in ranks]
    if todo:
        it = todo
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(todo, desc=f"corpus split (BM25 top-{depth})", unit="q")
        for ex in it:
            found = shown = None
            for i, hit in enumerate(retriever.search(ex.question, k=depth), start=1):
                if found is None and _contains_answer(f"{hit.title} {hit.text}", ex.answers):
                    found = i
                if found is not None and shows_answer(hit, READ_WORDS, ex.answers):
                    shown = i
                    break
            ranks[ex.id] = Ranks(found, shown)
        if cache_path is not None:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": _SPLIT_VERSION, "depth": depth, "ranks": ranks}))
            os.replace(tmp, cache_path)
    return {e.id: ranks[e.id] for e in examples}


def _split_cache(retriever, spec: BenchmarkSpec) -> Path | None:
    from fastgate.assets.paths import home

    manifest = getattr(retriever, "manifest", None) or {}
    fp = manifest.get("corpus_fingerprint")
    if not fp:
        return None
    corpus = manifest.get("corpus") or "corpus"
    return home() / "splits" / f"{corpus}-{fp}" / f"{spec.name}-{spec.split}-bm25top{ANSWERABILITY_DEPTH}" \
        f"-v{_SPLIT_VERSION}.json"


def _labelled_where_cached(examples: list[QAExample], spec: BenchmarkSpec, index, retriever) -> list[QAExample]:
    """``examples`` of subset ``all`` with their ``answerable`` label where the split's cache holds them all (a
    report's "AUROC answerable" was blank for natural-distribution runs though the split was cached); as they are
    where it does not, or the index is not built: nothing is computed or built for them."""
    from fastgate.errors import FastgateError

    try:
        if retriever is None:
            from fastgate.retrieval import open_retriever

            retriever = open_retriever("bm25", index, build_default=False)
        path = _split_cache(retriever, spec)
        stored = json.loads(path.read_text()) if path is not None and path.is_file() else None
    except (FastgateError, OSError, ValueError):
        return examples
    held = stored.get("ranks") if isinstance(stored, dict) and stored.get("version") == _SPLIT_VERSION \
        and stored.get("depth") == ANSWERABILITY_DEPTH else None
    if not isinstance(held, dict) or not all(e.id in held for e in examples):  # else it would search them all
        return examples
    try:
        return _labelled(examples, {e.id: Ranks(*held[e.id]) for e in examples})
    except TypeError:  # a corrupt entry: unlabelled (a split of its own subset recomputes it)
        return examples


def _labelled(examples: list[QAExample], ranks: dict[str, Ranks]) -> list[QAExample]:
    """``examples`` with ``answerable``, ``rank`` and ``shown_rank`` in their ``meta`` from ``ranks``."""
    return [QAExample(e.id, e.question, e.answers, e.evidence_title, e.source,
                      {**e.meta, "answerable": ranks[e.id].answerable, "rank": ranks[e.id].found,
                       "shown_rank": ranks[e.id].shown}) for e in examples]


def _interleave(a: list[QAExample], b: list[QAExample]) -> list[QAExample]:
    out = []
    for x, y in zip(a, b):
        out += [x, y]
    return out


def load_benchmark(data: str | BenchmarkSpec, *, seed: int = 0, n: int | None = None, index: str | Path | None = None,
                   retriever=None, jar: str | Path | None = None, progress: bool = True) -> list[QAExample]:
    """Questions of a benchmark split and corpus subset, in a seeded order; the first ``n`` (all when None).

    Subsets: ``all``; ``answerable`` / ``unanswerable`` by :func:`corpus_answerability` against the default corpus's
    BM25 index (or ``index``): a gold answer shown in the top READ_DEPTH passages as prompts show them / in none of
    the top ANSWERABILITY_DEPTH (questions between are in neither); ``balanced``: answerable and unanswerable
    questions alternate (each class shuffled with ``seed``), so every prefix holds equal numbers (±1) and is the same
    questions for any ``n``. Each example's ``meta`` has ``answerable``, ``rank`` (the first passage holding a gold
    answer) and ``shown_rank`` when a subset other than ``all`` is asked for, and for ``all`` where the split is
    cached already (nothing is searched for it). The counts go to stderr; ``progress``:
    the corpus split's progress bar.
    """
    import random

    spec = data if isinstance(data, BenchmarkSpec) else parse_benchmark(data)
    if n is not None and n < 1:
        raise InputError(f"n must be >= 1, got {n}")
    examples = benchmark_questions(spec.name, spec.split, jar=jar)
    order = list(examples)
    random.Random(seed).shuffle(order)
    if spec.subset == "all":
        return _labelled_where_cached(order if n is None else order[:n], spec, index, retriever)
    if retriever is None:
        from fastgate.retrieval import open_retriever

        retriever = open_retriever("bm25", index)
    ranks = corpus_answerability(examples, retriever, cache=_split_cache(retriever, spec), progress=progress)
    labelled = _labelled(order, ranks)
    yes = [e for e in labelled if ranks[e.id].answerable]
    no = [e for e in labelled if ranks[e.id].unanswerable]
    # the counts are no progress bar: printed without one too (`fastgate eval --quiet`)
    print(f"fastgate: {spec.name} {spec.split}: {len(examples)} questions, {len(yes)} answerable (a gold answer "
          f"shown in the BM25 top-{READ_DEPTH} the methods read), {len(no)} unanswerable (none in the top "
          f"{ANSWERABILITY_DEPTH}), {len(examples) - len(yes) - len(no)} between", file=sys.stderr)
    chosen = {"answerable": yes, "unanswerable": no, "balanced": _interleave(yes, no)}[spec.subset]
    if not chosen:
        raise CorpusError(f"{spec} is empty: no {spec.subset} question for this corpus")
    return chosen if n is None else chosen[:n]
