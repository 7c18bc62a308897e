"""Corpus loading, BM25 and dense retrieval on a small corpus, atomic builds and index errors."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from fastgate.assets.corpus import Passage, read_jsonl_corpus
from fastgate.errors import CorpusError, IndexError_, InputError, UnknownNameError
from fastgate.retrieval import BM25Retriever, DenseRetriever, Retriever, build_indexes, open_retriever
from fastgate.retrieval.base import atomic_index_dir, read_manifest
from fastgate.retrieval.bm25 import build_bm25_index, query_terms


def test_jsonl_corpus_reports_line_numbers(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "title": "A", "text": "x"}\n\n{"id": "b", "text": oops}\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:3: not valid JSON"):
        read_jsonl_corpus(path)
    path.write_text('{"id": "a", "title": "A"}\n')
    with pytest.raises(CorpusError, match=r":1: missing field\(s\) text"):
        read_jsonl_corpus(path)
    path.write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(CorpusError, match="duplicate id"):
        read_jsonl_corpus(path)
    with pytest.raises(CorpusError, match="not found"):
        read_jsonl_corpus(tmp_path / "nope.jsonl")
    path.write_bytes(b'{"id": "a", "text": "x"}\n{"id": "b", "text": "\xc9\xff"}\n')  # line 2 is not UTF-8
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2: not UTF-8 text"):
        read_jsonl_corpus(path)


def test_corpus_ids_titles_and_surrogates_are_checked_not_coerced(tmp_path):
    """str() made a null title the searchable word "None" and ids of "None" / "{'x': 1}"; a JSON "\\ud800" escape
    (a lone surrogate) passed the loader and raised a UnicodeEncodeError traceback in the fingerprint."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": 7, "title": null, "text": "x"}\n{"id": "b", "text": "y"}\n')
    assert [(p.id, p.title) for p in read_jsonl_corpus(path)] == [("7", ""), ("b", "")]  # integers: their digits
    for line, message in [('{"id": null, "text": "x"}', ":1: field id must be a string or an integer, not NoneType"),
                          ('{"id": true, "text": "x"}', "field id must be a string or an integer, not bool"),
                          ('{"id": {"x": 1}, "text": "x"}', "not dict"),
                          ('{"id": " ", "text": "x"}', ":1: field id is empty"),
                          ('{"id": "a", "title": ["a"], "text": "x"}', "field title must be a string, not list"),
                          ('{"id": "a", "text": "x\\ud800y"}', r":1: field text holds a lone surrogate escape"),
                          ('{"id": "a\\udc00", "text": "x"}', "field id holds a lone surrogate")]:
        path.write_text(line + "\n")
        with pytest.raises(CorpusError, match=message):
            read_jsonl_corpus(path)
    with pytest.raises(CorpusError, match="a directory, not a JSONL file"):
        read_jsonl_corpus(tmp_path)


def test_a_build_never_replaces_what_is_not_an_index(tmp_path, small_corpus_file):
    """--out holding a bm25/ of the user's own files: the build's swap deleted them (rc 0, no word)."""
    (tmp_path / "bm25").mkdir()
    (tmp_path / "bm25" / "precious.txt").write_text("mine")
    (tmp_path / "dense").write_text("mine too")
    with pytest.raises(InputError, match="exists and is not a fastgate index"):
        build_indexes(small_corpus_file, tmp_path, kinds=("bm25",), progress=False)
    with pytest.raises(InputError, match="exists and is not a fastgate index"):
        build_indexes(small_corpus_file, tmp_path, kinds=("dense",), progress=False, force=True)
    assert (tmp_path / "bm25" / "precious.txt").read_text() == "mine"
    assert (tmp_path / "dense").read_text() == "mine too"
    # both kinds: refused before either is built (bm25 was built, then dense/ refused)
    (tmp_path / "both").mkdir()
    (tmp_path / "both" / "dense").write_text("mine")
    with pytest.raises(InputError, match="exists and is not a fastgate index"):
        build_indexes(small_corpus_file, tmp_path / "both", kinds=("bm25", "dense"), progress=False)
    assert sorted(p.name for p in (tmp_path / "both").iterdir()) == ["dense"]


def test_a_build_replaces_another_corpus_s_index_only_when_forced(tmp_path, small_corpus_file, monkeypatch):
    """A user's corpus named like the default one (`fastgate index --corpus x/wiki-summaries.jsonl`, no --out) was
    built over the default corpus's index, which every later search then read; two user corpora of one name, or
    `--out DIR` holding another corpus's index, the same. Now refused without --force, the old index kept; the
    default corpus still rebuilds its own directory (a new version of its package)."""
    from fastgate.assets.corpus import DEFAULT_CORPUS
    from fastgate.assets.paths import index_dir

    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "o1", "title": "Other", "text": "Another corpus entirely."}) + "\n")
    built = build_indexes(small_corpus_file, tmp_path / "idx", kinds=("bm25",), progress=False)
    manifest = (built["bm25"] / "fastgate_index.json").read_text()
    with pytest.raises(InputError, match=r"holds the bm25 index of another corpus .*--force"):
        build_indexes(other, tmp_path / "idx", kinds=("bm25",), progress=False)
    assert (built["bm25"] / "fastgate_index.json").read_text() == manifest  # kept
    assert len(build_indexes(other, tmp_path / "idx", kinds=("bm25",), progress=False, force=True)) == 1
    assert json.loads((built["bm25"] / "fastgate_index.json").read_text())["n_passages"] == 1
    # the same corpus file, edited: its index rebuilt without --force (as before)
    other.write_text(other.read_text() + json.dumps({"id": "o2", "title": "More", "text": "A second one."}) + "\n")
    build_indexes(other, tmp_path / "idx", kinds=("bm25",), progress=False)
    assert json.loads((built["bm25"] / "fastgate_index.json").read_text())["n_passages"] == 2
    # a file of the same name elsewhere (another user's other.jsonl): another corpus, refused, the index kept
    twin = tmp_path / "elsewhere" / "other.jsonl"
    twin.parent.mkdir()
    twin.write_text(json.dumps({"id": "t1", "title": "Twin", "text": "Same name, other content."}) + "\n")
    with pytest.raises(InputError, match=rf"another corpus \(other from {re.escape(str(other.resolve()))}, 2 passages"):
        build_indexes(twin, tmp_path / "idx", kinds=("bm25",), progress=False)
    assert json.loads((built["bm25"] / "fastgate_index.json").read_text())["n_passages"] == 2
    # the default corpus's directory: a user's file of that name is refused; the default corpus itself replaces
    # whatever is there (here a user's index left by an older fastgate)
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    root = index_dir(DEFAULT_CORPUS)
    build_indexes(other, root, kinds=("bm25",), progress=False)
    named = tmp_path / f"{DEFAULT_CORPUS}.jsonl"
    named.write_text(small_corpus_file.read_text())
    with pytest.raises(InputError, match="another corpus"):
        build_indexes(named, None, kinds=("bm25",), progress=False)
    build_indexes(DEFAULT_CORPUS, root, kinds=("bm25",), progress=False)
    assert json.loads((root / "bm25" / "fastgate_index.json").read_text())["n_passages"] > 1000


def test_a_damaged_index_is_built_again_not_called_up_to_date(tmp_path, small_corpus_file, capsys):
    """A deleted or truncated index file: `fastgate index` said "up to date" and every search said "rebuild it"."""
    built = build_indexes(small_corpus_file, tmp_path, progress=False)
    for p in built["bm25"].glob("*.store"):
        p.unlink()
    (built["dense"] / "index.faiss").write_bytes(b"")
    with pytest.raises(IndexError_):
        BM25Retriever(built["bm25"])
    build_indexes(small_corpus_file, tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "up to date" not in err and err.count("building it again") == 2
    assert BM25Retriever(built["bm25"]).search("capital of France", k=1)[0].passage.id == "p1"
    assert DenseRetriever(built["dense"], device="cpu").search("capital of France", k=1)
    for part in built["bm25"].iterdir():  # tantivy's meta.json and .managed.json were 0600: other users kept out
        assert part.stat().st_mode & 0o444 == 0o444, part


def test_passages_without_text_are_skipped_and_said(tmp_path, caplog):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "  \\n\\t "}\n{"id": "c", "text": ""}\n'
                    '{"id": "d", "title": "D", "text": "y"}\n')
    with caplog.at_level("WARNING", logger="fastgate.assets.corpus"):
        passages = read_jsonl_corpus(path)
    assert [p.id for p in passages] == ["a", "d"]
    assert [r.getMessage() for r in caplog.records] == [f"fastgate: warning: {path}: skipped 2 passage(s) with no "
                                                       "text (lines 2, 3)"]
    path.write_text('{"id": "a", "text": " "}\n')
    with pytest.raises(CorpusError, match="the corpus is empty"):
        read_jsonl_corpus(path)


def test_bm25_known_top_hit(small_index):
    r = BM25Retriever(small_index / "bm25")
    assert isinstance(r, Retriever)
    assert len(r) == 7
    hits = r.search("What is the capital of Burkina Faso?", k=3)
    assert hits[0].id == "p3" and hits[0].title == "Ouagadougou"
    assert hits[0].score >= hits[-1].score
    assert r.search("Who wrote Hamlet?", k=1)[0].id == "p5"
    batch = r.search_batch(["capital of Kyrgyzstan", "largest planet", "Eiffel 1889"], k=2)
    assert [b[0].id for b in batch] == ["p4", "p7", "p6"]


def test_bm25_query_syntax_cannot_break_search(small_index):
    r = BM25Retriever(small_index / "bm25")
    assert r.search('capital "of (Germany: AND OR -', k=1)[0].id == "p2"
    assert r.search("?!...", k=3) == []
    assert query_terms("Zürich's CAFÉ!") == "zürich s café"
    with pytest.raises(InputError):
        r.search("x", k=0)
    with pytest.raises(InputError):
        r.search("x", k=True)  # True is an int: it searched for one passage (dense raised a TypeError)


def test_bm25_finds_words_of_scripts_with_combining_marks(tmp_path):
    """Python's word pattern leaves combining marks out: हिन्दी became "ह न द" and matched nothing, as did Thai and
    Arabic with its vowel marks."""
    rows = [{"id": "h1", "title": "हिन्दी", "text": "हिन्दी भारत की राजभाषा है।"},
            {"id": "t1", "title": "ไทย", "text": "กรุงเทพมหานคร เป็นเมืองหลวง"},
            {"id": "a1", "title": "عربي", "text": "القاهرةُ عاصمةُ مصر"},
            {"id": "r1", "title": "Москва", "text": "Москва — столица России."}]
    corpus = tmp_path / "intl.jsonl"
    corpus.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    build_indexes(corpus, tmp_path / "index", kinds=("bm25",), progress=False)
    r = BM25Retriever(tmp_path / "index" / "bm25")
    for query, want in [("हिन्दी", "h1"), ("राजभाषा", "h1"), ("กรุงเทพมหานคร", "t1"), ("القاهرةُ", "a1"),
                        ("Москва?", "r1")]:
        assert [h.id for h in r.search(query, k=1)] == [want], query


def test_dense_search_of_an_empty_query_finds_nothing(small_index):
    d = DenseRetriever(small_index / "dense")
    assert d.search("", k=3) == [] and d.search("  ", k=3) == []  # it ranked passages by the embedding of ""
    both = d.search_batch(["", "capital of Germany"], k=1)
    assert both[0] == [] and both[1] == d.search("capital of Germany", k=1)


def test_dense_known_top_hit(small_index):
    r = DenseRetriever(small_index / "dense", device="cpu")
    assert r.search("Which city is the capital of Kyrgyzstan?", k=1)[0].id == "p4"
    batch = r.search_batch(["the biggest planet of the solar system", "who wrote the tragedy Hamlet"], k=3)
    assert [b[0].id for b in batch] == ["p7", "p5"]
    assert all(len(b) == 3 for b in batch)
    assert r.search("anything", k=50)[0] is not None  # k larger than the corpus is clipped
    vec = np.load(small_index / "dense" / "vectors.npy")
    np.testing.assert_allclose(np.linalg.norm(vec, axis=1), 1.0, atol=1e-5)


def test_atomic_build_keeps_previous_index_on_crash(tmp_path):
    passages = [Passage("a", "Alpha", "alpha text"), Passage("b", "Beta", "beta text")]
    target = tmp_path / "bm25"
    build_bm25_index(passages, target)
    with pytest.raises(RuntimeError):
        with atomic_index_dir(target, "bm25", {}) as tmp:
            (tmp / "junk").write_text("half")
            raise RuntimeError("crash mid-build")
    assert BM25Retriever(target).search("beta", 1)[0].id == "b"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left behind
    assert target.stat().st_mode & 0o777 == 0o755  # readable by other users (mkdtemp makes 0700)


def test_missing_and_corrupt_indexes_fail_clearly(tmp_path, small_index):
    with pytest.raises(IndexError_, match="no bm25 index"):
        BM25Retriever(tmp_path / "missing")
    half = tmp_path / "half"
    half.mkdir()
    with pytest.raises(IndexError_, match="not a complete"):
        BM25Retriever(half)
    broken = tmp_path / "broken"
    shutil.copytree(small_index / "dense", broken)
    (broken / "fastgate_index.json").write_text("{not json")
    with pytest.raises(IndexError_, match="corrupt"):
        DenseRetriever(broken)
    (broken / "fastgate_index.json").write_bytes(b"{\xc9\xff binary")  # not UTF-8 text at all
    with pytest.raises(IndexError_, match="corrupt"):
        DenseRetriever(broken)
    shutil.copytree(small_index / "dense", tmp_path / "dense2")
    (tmp_path / "dense2" / "index.faiss").write_bytes(b"garbage")
    with pytest.raises(IndexError_, match="cannot read"):
        DenseRetriever(tmp_path / "dense2")
    with pytest.raises(IndexError_, match="holds a 'dense' index"):
        read_manifest(small_index / "dense", "bm25")
    wrong = tmp_path / "wrong"
    shutil.copytree(small_index / "bm25", wrong)
    manifest = json.loads((wrong / "fastgate_index.json").read_text())
    manifest["n_passages"] = 99
    (wrong / "fastgate_index.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexError_, match="rebuild"):
        BM25Retriever(wrong)
    manifest["n_passages"] = "7"
    (wrong / "fastgate_index.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexError_, match="no passage count"):  # said "has 7 documents but its manifest says 7"
        BM25Retriever(wrong)
    for doc in ([], "x", None):  # valid JSON, not an object: AttributeError 'list' object has no attribute 'get'
        (wrong / "fastgate_index.json").write_text(json.dumps(doc))
        with pytest.raises(IndexError_, match="not a manifest"):
            BM25Retriever(wrong)
    lost = tmp_path / "lost"
    shutil.copytree(small_index / "bm25", lost)
    for f in lost.glob("*.pos"):  # a lost segment file: the index opens (tantivy reads it lazily), every search
        f.unlink()  # failed with a raw ValueError (a 500 on every request of a server)
    with pytest.raises(IndexError_, match="cannot be searched"):
        BM25Retriever(lost).search("capital", k=3)


def test_build_indexes_skips_up_to_date_and_rejects_unknown(tmp_path, small_corpus_file, capsys):
    built = build_indexes(small_corpus_file, tmp_path, kinds=("bm25",), progress=True)
    stamp = (built["bm25"] / "fastgate_index.json").stat().st_mtime_ns
    build_indexes(small_corpus_file, tmp_path, kinds=("bm25",), progress=True)
    assert (built["bm25"] / "fastgate_index.json").stat().st_mtime_ns == stamp
    assert "up to date" in capsys.readouterr().err
    with pytest.raises(UnknownNameError):
        build_indexes(small_corpus_file, tmp_path, kinds=("sparse",))
    with pytest.raises(UnknownNameError):
        open_retriever("elastic", tmp_path)


def test_dense_hnsw_index(tmp_path, small_corpus_file):
    from fastgate.assets.corpus import read_jsonl_corpus
    from fastgate.retrieval.dense import build_dense_index

    target = build_dense_index(read_jsonl_corpus(small_corpus_file), tmp_path / "dense", hnsw=True, hnsw_m=8)
    r = DenseRetriever(target, device="cpu")
    assert r.manifest["index_type"] == "hnsw"
    assert r.search("Which city is the capital of Kyrgyzstan?", k=1)[0].id == "p4"


def _dead_pid() -> int:
    """The pid of a process that has exited (what a build killed with -9 leaves in its directory names)."""
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_next_build_removes_what_killed_builds_left(tmp_path, small_corpus_file):
    import os

    root = tmp_path / "idx"
    build_indexes(small_corpus_file, root, progress=False)
    dead, live = _dead_pid(), os.getppid()
    leftovers = {}
    for kind in ("bm25", "dense"):
        for name in (f".{kind}.building-{dead}-x1", f".{kind}.building-legacy9z",  # killed; an old version's name
                     f".{kind}.old-{dead}-5", f".{kind}.building-{live}-busy"):  # a live concurrent build
            (root / name).mkdir()
            (root / name / "segment").write_text("half")
        leftovers[kind] = f".{kind}.building-{live}-busy"
    build_indexes(small_corpus_file, root, progress=False, force=True)
    assert sorted(p.name for p in root.iterdir()) == sorted(["bm25", "dense", *leftovers.values()])
    assert BM25Retriever(root / "bm25").search("capital of Kyrgyzstan", k=1)[0].id == "p4"
    assert DenseRetriever(root / "dense", device="cpu").search("capital of Kyrgyzstan", k=1)[0].id == "p4"


def test_a_build_killed_between_the_two_renames_gets_its_old_index_back(tmp_path):
    from fastgate.retrieval.base import cleanup_killed_builds

    target = tmp_path / "bm25"
    with atomic_index_dir(target, "bm25", {"n": 1}):
        pass
    old = tmp_path / f".bm25.old-{_dead_pid()}-1"
    target.rename(old)  # killed after moving the old index aside, before moving the new one in
    (tmp_path / f".bm25.building-{_dead_pid()}-x").mkdir()
    removed = cleanup_killed_builds(target)
    assert read_manifest(target, "bm25")["n"] == 1  # the previous index is back in place
    assert len(removed) == 1 and removed[0].name.startswith(".bm25.building-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bm25"]


def test_kill_9_during_a_build_then_the_next_build_cleans_up(tmp_path, small_corpus_file):
    """A real ``kill -9`` of a process in the middle of ``fastgate index --force``'s atomic build."""
    import os
    import signal
    import subprocess
    import sys

    root = tmp_path / "idx"
    build_indexes(small_corpus_file, root, kinds=("bm25",), progress=False)
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from fastgate.retrieval.base import atomic_index_dir\n"
        "with atomic_index_dir(Path(sys.argv[1]), 'bm25', {}) as tmp:\n"
        "    (tmp / 'segment').write_bytes(b'x' * 1000)\n"
        "    print('building', flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(root / "bm25")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "building"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    stale = [p.name for p in root.iterdir() if p.name.startswith(".bm25.building-")]
    assert stale and all(n.startswith(f".bm25.building-{proc.pid}-") for n in stale)
    assert BM25Retriever(root / "bm25").search("Hamlet", k=1)[0].id == "p5"  # the old index still answers
    build_indexes(small_corpus_file, root, kinds=("bm25",), progress=False, force=True)
    assert sorted(p.name for p in root.iterdir()) == ["bm25"]
    assert BM25Retriever(root / "bm25").search("Hamlet", k=1)[0].id == "p5"


@pytest.mark.parametrize("force", [False, True])
def test_builds_starting_together_build_once(tmp_path, small_corpus_file, monkeypatch, force):
    """Two processes opening a missing index at once (or both forcing a rebuild): the second waits for the first's
    build and keeps it."""
    import threading
    import time

    import fastgate.retrieval.bm25 as bm25

    real, calls = bm25.build_bm25_index, []

    def slow_build(*args, **kwargs):
        calls.append(1)
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(bm25, "build_bm25_index", slow_build)
    got = []
    threads = [threading.Thread(target=lambda: got.append(
        build_indexes(small_corpus_file, tmp_path / "idx", kinds=("bm25",), progress=False, force=force)["bm25"]))
        for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 2
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == ["bm25"]  # no lock file left
    assert BM25Retriever(got[0]).search("capital of France", k=1)[0].passage.id == "p1"


def test_a_lock_that_cannot_be_made_does_not_stop_a_build(tmp_path, small_corpus_file, monkeypatch):
    """Where the lock file cannot be created the build runs unlocked (and says why itself if it cannot write)."""
    import os

    real = os.open

    def no_lock(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise PermissionError(13, "read-only", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_lock)
    built = build_indexes(small_corpus_file, tmp_path / "idx", kinds=("bm25",), progress=False)["bm25"]
    assert BM25Retriever(built).search("Hamlet", k=1)[0].id == "p5"


def test_a_runtime_refuses_indexes_of_two_corpora_side_by_side(tmp_path, small_corpus_file, tiny_engine):
    """A build interrupted between its two kinds (or one kind re-indexed with another corpus) left BM25 and dense
    indexes of different passages under one root; both opened and were combined without a word."""
    from fastgate.serving.runtime import Runtime

    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "o1", "title": "Other", "text": "Another corpus entirely."}) + "\n")
    root = tmp_path / "index"
    build_indexes(small_corpus_file, root, progress=False)
    runtime = Runtime("tiny", index=str(root), engine=tiny_engine)
    assert runtime.retriever("bm25") and runtime.retriever("dense")  # one corpus: fine
    build_indexes(other, root, kinds=("bm25",), progress=False, force=True)
    mixed = Runtime("tiny", index=str(root), engine=tiny_engine)
    mixed.retriever("dense")
    for _ in range(2):  # refused again: it is not kept (a second call returned it unchecked)
        with pytest.raises(IndexError_, match="different corpora"):
            mixed.retriever("bm25")


_SEARCH_READ_ONLY = """
import sys
from fastgate.retrieval.bm25 import BM25Retriever
r = BM25Retriever(sys.argv[1])
links = r._shadow.peek()[2][0]  # the directory of links it was opened through
print(len(r), r.search("capital of France", k=1)[0].passage.id, links.is_dir(), end=" ")
r.close()
print(links.exists(), r.search("Rome", k=1)[0].passage.id)  # removed; the open searcher still reads
"""


def test_a_read_only_bm25_index_is_searched_through_links(tmp_path):
    """tantivy locks `.tantivy-meta.lock` in the index directory even to search: an index whose directory this user
    cannot write (a read-only mount, another user's) and that lacks the file is opened through links to its files."""
    import os
    import subprocess
    import sys

    passages = [Passage("p1", "Paris", "Paris is the capital of France."), Passage("p2", "Rome", "Rome is in Italy.")]
    index = build_bm25_index(passages, tmp_path / "bm25")
    for lock in index.glob(".tantivy-*"):
        lock.unlink()
    before = sorted(p.name for p in index.iterdir())
    index.chmod(0o555)
    # root ignores the mode: the search runs without the capability that lets it
    prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if os.geteuid() == 0 else []
    if prefix and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a directory's mode cannot be made to bind")
    try:
        # setpriv without CAP_SETPCAP (some containers) exits 0 and drops nothing: the mode must bind for real
        if subprocess.run([*prefix, "sh", "-c", f"test ! -w '{index}'"], capture_output=True).returncode != 0:
            pytest.skip("the directory's mode does not bind here (root whose capabilities cannot be dropped)")
        run = subprocess.run([*prefix, sys.executable, "-c", _SEARCH_READ_ONLY, str(index)], capture_output=True,
                             text=True, timeout=120)
    finally:
        index.chmod(0o755)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["2", "p1", "True", "False", "p2"]
    assert sorted(p.name for p in index.iterdir()) == before  # nothing written into it


def test_the_links_directory_is_removed_when_a_file_reappears_in_it(tmp_path, monkeypatch):
    """tantivy's watcher thread can make `.tantivy-meta.lock` anew while the directory of links is being removed (its
    meta.json link gone): the removal tries again (a full test run once left the directory behind)."""
    import os
    import shutil

    from fastgate.retrieval import bm25

    shadow = tmp_path / "fastgate-bm25-x"
    shadow.mkdir()
    (shadow / "meta.json").write_text("{}")
    real, calls = shutil.rmtree, []

    def racing_rmtree(path, ignore_errors=False):
        calls.append(1)
        real(path, ignore_errors=ignore_errors)
        if len(calls) == 1:  # the watcher's lock file, made again as the first removal ends
            shadow.mkdir()
            (shadow / ".tantivy-meta.lock").touch()

    monkeypatch.setattr(bm25.shutil, "rmtree", racing_rmtree)
    bm25._remove_shadow(shadow, os.getpid())
    assert not shadow.exists() and len(calls) == 2
    shadow.mkdir()
    bm25._remove_shadow(shadow, os.getpid() + 1)  # another process's (a forked child's): left to its maker
    assert shadow.exists()
