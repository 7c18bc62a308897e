"""The CLI's error map for the places fastgate writes: a full disk (ENOSPC), a directory without write permission
(EACCES) or a read-only file system (EROFS) ends in one line naming the path and status 2, not a traceback, and
leaves nothing half-written: the dense index is built in a temporary directory renamed when complete, and the eval
records are appended whole (a run resumes cleanly afterwards).

The writes are made to fail by monkeypatching (the tests run as any user, root included, so permissions cannot be
relied on); the model is the tiny one of ``fastgate.testing``.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path

import pytest

from fastgate.entrypoints.cli import main
from fastgate.errors import DISK_ERRORS, WriteError, disk_error

QUESTIONS = [("What is the capital of France?", ["Paris"]), ("Who wrote Hamlet?", ["Shakespeare"]),
             ("What is the capital of Kyrgyzstan?", ["Bishkek"]), ("What is the largest planet?", ["Jupiter"]),
             ("When was the Eiffel Tower completed?", ["1889"])]


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("fastgate: error:")]


def _leftovers(root: Path) -> list[str]:
    """Files and directories a failed build may have left under ``root`` (temporary build directories included)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# ------------------------------------------------------------------------------------------------ the error type
def test_disk_error_maps_the_three_errors_and_nothing_else():
    for code, words in DISK_ERRORS.items():
        err = disk_error(OSError(code, os.strerror(code)), "cannot write", "/data/x")
        assert isinstance(err, WriteError) and isinstance(err, OSError) and err.errno == code
        assert str(err) == f"cannot write /data/x: {words}"
    assert disk_error(OSError(errno.ENOENT, "No such file or directory"), "cannot write", "/x") is None
    assert disk_error(ValueError("No space left on device"), "cannot write", "/x") is None
    # faiss reports the C error in words inside a RuntimeError
    faiss = RuntimeError("Error in faiss::FileIOWriter::operator() at io.cpp:117: write error in /x/index.faiss: "
                         "10 != 4096 (No space left on device)")
    assert disk_error(faiss, "cannot write the dense index", "/x").errno == errno.ENOSPC
    assert disk_error(RuntimeError("could not open /x for writing: Read-only file system"), "w", "/x").errno == \
        errno.EROFS
    assert disk_error(RuntimeError("some other faiss error"), "w", "/x") is None


def test_main_maps_a_raw_os_error_to_one_line(monkeypatch, capsys):
    import fastgate.retrieval

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", "/mnt/ro/indexes")

    monkeypatch.setattr(fastgate.retrieval, "build_indexes", read_only)
    assert main(["index", "--corpus", "x.jsonl"]) == 2
    assert _error_lines(capsys.readouterr().err) == ["fastgate: error: cannot write /mnt/ro/indexes: read-only "
                                                     "file system"]

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/root/corpus.jsonl")

    monkeypatch.setattr(fastgate.retrieval, "build_indexes", denied)
    assert main(["index", "--corpus", "x.jsonl"]) == 2
    assert _error_lines(capsys.readouterr().err) == ["fastgate: error: cannot access /root/corpus.jsonl: permission "
                                                     "denied"]

    def other(*args, **kwargs):  # any other OSError is a bug or an environment problem: unchanged, it propagates
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fastgate.retrieval, "build_indexes", other)
    with pytest.raises(OSError, match="Input/output"):
        main(["index", "--corpus", "x.jsonl"])


# ------------------------------------------------------------------------------------------------ fastgate index
def test_index_on_a_full_disk(monkeypatch, capsys, tmp_path, small_corpus_file):
    import faiss

    def full_disk(index, path):  # faiss writes part of the file, then reports the failed fwrite
        Path(path).write_bytes(b"IxF2" + b"\0" * 10)
        raise RuntimeError(f"Error in faiss::FileIOWriter::operator()(const void*, size_t, size_t) at "
                           f"/project/faiss/impl/io.cpp:117: write error in {path}: 14 != 4096 "
                           f"(No space left on device)")

    monkeypatch.setattr(faiss, "write_index", full_disk)
    out = tmp_path / "idx"
    (out / "dense").mkdir(parents=True)
    (out / "dense" / "previous").write_text("an earlier index")  # stays as it was
    (out / "dense" / "fastgate_index.json").write_text("{}")  # (an index: a build replaces nothing else)
    assert main(["index", "--corpus", str(small_corpus_file), "--out", str(out), "--retriever", "dense"]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert lines == [f"fastgate: error: cannot write the dense index {out / 'dense'}: no space left on device"]
    # no temporary build directory, no half index
    assert _leftovers(out) == ["dense", "dense/fastgate_index.json", "dense/previous"]


def test_index_without_write_permission(monkeypatch, capsys, tmp_path, small_corpus_file):
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if str(file).endswith("passages.jsonl"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    out = tmp_path / "idx"
    assert main(["index", "--corpus", str(small_corpus_file), "--out", str(out), "--retriever", "dense"]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert lines == [f"fastgate: error: cannot write the dense index {out / 'dense'}: permission denied"]
    assert _leftovers(out) == []


# ------------------------------------------------------------------------------------------------- fastgate eval
@pytest.fixture
def eval_argv(monkeypatch, tmp_path, tiny, small_index):
    import fastgate.assets.models

    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": a}) + "\n" for q, a in QUESTIONS))
    out = tmp_path / "out"
    return out, ["eval", "--method", "never", "--data", str(data), "--index", str(small_index), "--out", str(out),
                 "--model", "tiny", "--quiet", "--batch-size", "2"]


def _whole_records(path: Path) -> int:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n")  # no partial record
    lines = data.decode("utf-8").splitlines()
    for line in lines:
        json.loads(line)
    return len(lines)


def test_eval_on_a_full_disk_keeps_whole_records_and_resumes(monkeypatch, capsys, eval_argv):
    out, argv = eval_argv
    results = out / "results.jsonl"
    real_write = os.write
    appends = []

    def full_after_one_batch(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target == str(results):
            appends.append(len(data))
            if len(appends) >= 2:  # the second batch: part of it reaches the disk, then the disk is full
                real_write(fd, bytes(data[: len(data) // 2]))
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_after_one_batch)
    assert main(argv) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert lines == [f"fastgate: error: cannot append results to {results}: no space left on device"]
    assert _whole_records(results) == 2  # the first batch; the second was cut back off
    assert [p.name for p in out.glob(".*")] == [".lock"]  # no temporary files (the lock stays, released)
    monkeypatch.setattr(os, "write", real_write)
    assert main(argv) == 0  # the run resumes cleanly
    assert "resuming: 2/5 already done" in capsys.readouterr().err
    assert _whole_records(results) == 5


def test_eval_without_write_permission(monkeypatch, capsys, eval_argv):
    out, argv = eval_argv
    results = out / "results.jsonl"
    real_open = os.open

    def denied(path, flags, *args, **kwargs):
        if str(path) == str(results) and flags & os.O_WRONLY:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    assert main(argv) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert lines == [f"fastgate: error: cannot append results to {results}: permission denied"]
    assert not results.exists()
    # the directory this run made, holding only its settings and lock, is removed again: nothing was recorded
    assert not out.exists()
    out.mkdir()  # one that was there before stays, with the settings written whole before the first answer
    assert main(argv) == 2
    assert sorted(p.name for p in out.iterdir()) == [".lock", "eval.json"]


def test_eval_summary_on_a_read_only_file_system(monkeypatch, capsys, eval_argv):
    from fastgate.eval import runner

    out, argv = eval_argv
    real_replace = os.replace

    def read_only(src, dst):
        if Path(dst).name == "summary.md":
            raise OSError(errno.EROFS, "Read-only file system", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(runner.os, "replace", read_only)
    assert main(argv) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert lines == [f"fastgate: error: cannot write {out / 'summary.md'}: read-only file system"]
    assert sorted(p.name for p in out.iterdir()) == [".lock", "eval.json", "results.jsonl"]  # no temporary summary


def test_missing_serving_extras_are_a_missing_dependency_with_the_install_hint(monkeypatch):
    """The serving and Ray hints were InputErrors: `except ImportError` around them (a library user's optional
    import) missed them."""
    import builtins

    from fastgate.entrypoints.http.common import require_serving
    from fastgate.errors import FastgateError, MissingDependencyError

    real = builtins.__import__

    def without(*names):
        def fake(name, *args, **kwargs):
            if name.split(".")[0] in names:
                raise ImportError(f"no {name}", name=name)
            return real(name, *args, **kwargs)
        return fake

    monkeypatch.setattr(builtins, "__import__", without("fastapi"))
    with pytest.raises(MissingDependencyError, match=r"fastgate\[serve\]") as err:
        require_serving()
    assert isinstance(err.value, ImportError) and isinstance(err.value, FastgateError)
    from fastgate.entrypoints.ray_serve import _ray

    monkeypatch.setattr(builtins, "__import__", without("ray"))
    with pytest.raises(MissingDependencyError, match=r"fastgate\[ray\]"):
        _ray()
