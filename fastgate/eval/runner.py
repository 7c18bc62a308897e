"""The evaluation harness behind ``fastgate eval``: run methods over a QA set, score every answer, write per-question
records incrementally (resumable), then summary tables and accuracy-vs-retrieval plots.

Layout of an output directory::

    DIR/eval.json        model, data, question order seed, thresholds (calibrated or paper): a rerun must match
    DIR/results.jsonl    one record per (run, question); appended after every batch, so an interrupted run resumes
    DIR/summary.md|csv   one row per run (method + parameters)
    DIR/*.png            accuracy vs retrieval rate (sweeps and --all)

Nothing is left half-written: records are appended whole (a failed append is cut back off the file) and every other
file is written beside its place and renamed into it. A disk that is full, a directory without write permission or a
read-only file system raises :class:`~fastgate.errors.WriteError` naming the file (the CLI's one line).

One invocation at a time: ``fastgate eval`` holds ``DIR/.lock`` (:func:`hold_out_dir`) while it runs, and one directory
holds the records of one engine, dtype and weights (:func:`check_form`).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from fastgate.assets.pins import DEFAULT_MODEL
from fastgate.errors import InputError, RemoteError, disk_error
from fastgate.eval.datasets import QAExample
from fastgate.eval.metrics import accuracy, decision, exact_match, token_f1

try:
    import fcntl
except ImportError:  # not a POSIX system: no lock on the output directory
    fcntl = None  # type: ignore[assignment]

# how an evaluation feeds a run's questions to the engine: ``window``, a fixed number in flight (a new one joins as one
# ends; the default: what a busy server's engine sees), or ``batches`` one after another (each waits for its slowest)
SCHEDULES = ("window", "batches")

__all__ = [
    "EvalSettings",
    "ResultsStore",
    "RunSpec",
    "RunSummary",
    "SCHEDULES",
    "check_form",
    "evaluate",
    "has_results",
    "hold_out_dir",
    "plot_accuracy_vs_retrieval",
    "replace_file",
    "save_figure",
    "schedule_line",
    "summarize",
    "write_summary",
]


@dataclass(frozen=True)
class EvalSettings:
    """What must stay fixed for the records of one output directory to be comparable and resumable."""

    model: str = DEFAULT_MODEL  # the default embedded model
    data: str = "heldout"  # the documented held-out split: training never saw it
    seed: int = 0  # order in which questions are drawn; the first n of a seed are the same questions for any n
    paper_defaults: bool = False  # thresholds: the papers' values instead of those calibrated for the model


@dataclass(frozen=True)
class RunSpec:
    """One configuration to evaluate: a method, its retriever and the user's parameters (a sweep point)."""

    method: str
    retriever: str | None
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def key(self) -> str:
        """Stable name of the run in records and tables, e.g. ``dtr`` or ``flare[theta=0.3]``."""
        from fastgate.methods import METHODS

        parts = [f"{k}={v}" for k, v in self.params]
        if self.retriever is not None and self.retriever != METHODS[self.method].default_retriever:
            parts.append(f"retriever={self.retriever}")
        return f"{self.method}[{','.join(parts)}]" if parts else self.method


@dataclass(frozen=True)
class RunSummary:
    """Aggregate figures of one run over the evaluated questions."""

    run: str
    method: str
    n: int
    em: float
    f1: float
    acc: float
    retrieval_rate: float  # fraction of questions that retrieved at least once
    retrievals_per_q: float
    lm_calls_per_q: float
    tokens_per_q: float
    latency_p50_s: float  # per question: its own time in flight (window), or its batch's wall time (batches)
    latency_p95_s: float
    questions_per_s: float
    gate_share: float  # gate time / answering time
    errors: int  # questions the method rejected (recorded with their error, scored 0)
    em_se: float = float("nan")  # standard errors of the means: sample standard deviation / sqrt(n)
    f1_se: float = float("nan")
    acc_se: float = float("nan")
    s_per_q: float = float("nan")  # wall seconds per question (1 / questions_per_s): what the time-matched coin pays
    prompt_tokens_per_q: float = 0.0  # prompt tokens of every LM call, per question
    invocations: int = 0  # how many `fastgate eval` invocations answered these records (1: timed in one sitting)
    # the share of the run's wall time in questions that took over SLOW_FACTOR times the run's median question: a
    # machine busy with something else part of the time (a baseline does the same work for every question)
    slow_share: float = 0.0


class ResultsStore:
    """``results.jsonl`` of an output directory: loads finished records, appends new ones durably.

    A line cut by an interruption (no final newline) is dropped on open, so appending never glues two records.
    Where only ``results.jsonl.gz`` is there (records committed compressed: docs/results), it is read, and the first
    append writes it out as ``results.jsonl`` before adding to it; reading writes nothing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: dict[tuple[str, str], dict[str, Any]] = {}
        self._packed: bytes | None = None  # the records read from results.jsonl.gz, until an append writes them out
        gz = packed_path(self.path)
        if self.path.exists():
            self._load(self.path.read_bytes(), self.path)
        elif gz.exists():
            self._packed = _gunzip(gz)
            self._load(self._packed, gz)

    def _load(self, data: bytes, where: Path) -> None:
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            if where == self.path:
                with open(self.path, "r+b") as f:  # drop the partial last line
                    f.truncate(cut)
            data = data[:cut]
            if self._packed is not None:
                self._packed = data
        for n, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            try:  # ValueError: not JSON, or not UTF-8 text at all
                rec = json.loads(line.decode("utf-8"))
                self.records[(rec["run"], rec["id"])] = rec
            except (ValueError, KeyError, TypeError) as exc:
                raise InputError(f"{where}:{n} is not a result record ({exc}); move the file away to start "
                                 "over") from None

    def done(self, run: str, example_id: str) -> bool:
        return (run, example_id) in self.records

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Append ``records`` durably and whole: if the write fails, the file is cut back to where it ended."""
        records = list(records)
        if not records:
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        if self._packed is not None and not self.path.exists():  # the compressed records first, then these
            data = self._packed + data
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                end = os.lseek(fd, 0, os.SEEK_END)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                except OSError:
                    os.ftruncate(fd, end)  # no partial record stays behind
                    raise
            finally:
                os.close(fd)
        except OSError as exc:
            raise _write_error(exc, "cannot append results to", self.path) from None
        self._packed = None
        for r in records:
            self.records[(r["run"], r["id"])] = r


def packed_path(path: Path) -> Path:
    """``results.jsonl.gz`` beside ``results.jsonl``: records committed compressed."""
    return path.with_name(path.name + ".gz")


def _gunzip(path: Path) -> bytes:
    import gzip
    import zlib

    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise InputError(f"{path} is not a readable gzip file ({exc}); move it away to start over") from None


def check_settings(out_dir: Path, settings: EvalSettings) -> None:
    """Write ``eval.json`` on first use; refuse to mix records made under different settings.

    An ``eval.json`` with no records beside it (an invocation that failed before answering, e.g. on a mistyped
    ``--model``) is replaced: there is nothing to mix."""
    path = out_dir / "eval.json"
    mine = asdict(settings)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} is a file: an evaluation writes a directory (--out)")
    if path.exists():
        try:
            theirs = json.loads(path.read_text())
        except ValueError as exc:  # not JSON, or not UTF-8 text at all
            raise InputError(f"{path} is corrupt ({exc}); remove it or use another --out") from None
        if not isinstance(theirs, dict):
            raise InputError(f"{path} is corrupt (not a JSON object of settings); remove it or use another --out")
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if not diff:
            return
        if _holds_records(out_dir):
            what = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
            raise InputError(f"{out_dir} holds an evaluation with other settings ({what}); use another --out")
    make_out_dir(out_dir)
    replace_file(path, lambda tmp: tmp.write_text(json.dumps(mine, indent=1) + "\n"))


def _holds_records(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a record file that is not empty (``results.jsonl``, ``always-again.jsonl``, also
    gzipped as docs/results commits them)."""
    try:
        return any(p.is_file() and p.stat().st_size > 0 for pattern in ("*.jsonl", "*.jsonl.gz")
                   for p in out_dir.glob(pattern))
    except OSError:
        return True  # unreadable: as if it held records (refused, never overwritten)


def make_out_dir(out_dir: Path) -> None:
    """Create the output directory ``out_dir`` (``--out``) and its parents.

    Raises:
        InputError: it is a file, or it cannot be made for another reason than the disk's (a part of its path is a
            file, a file system that takes no directories there such as ``/proc``), named as ``--out``.
        WriteError: the disk is full, not writable or read-only."""
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} is a file: an evaluation writes a directory (--out)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if (err := disk_error(exc, "cannot create", out_dir)) is not None:
            raise err from None
        why = ("a part of its path is a file" if exc.errno in (errno.ENOTDIR, errno.EEXIST)
               else (exc.strerror or str(exc)).lower())
        raise InputError(f"--out {out_dir}: cannot create the directory ({why})") from None


LOCK_FILE = ".lock"


def has_results(out: Path) -> bool:
    """Whether ``out`` holds answered questions (a ``results.jsonl`` that is not empty; unreadable counts as held):
    where it does not, ``eval`` and ``calibrate`` load the model before they make ``out`` (a mistyped ``--model``
    left the directory behind)."""
    try:
        return (out / "results.jsonl").stat().st_size > 0
    except FileNotFoundError:
        return packed_path(out / "results.jsonl").exists()
    except OSError:
        return True


@contextlib.contextmanager
def hold_out_dir(out_dir: Path, what: str = "fastgate eval") -> Iterator[None]:
    """Create ``out_dir`` and hold ``out_dir/.lock`` exclusively (``flock``) until the block ends, however it ends;
    the file names the holder's pid. Two evaluations into one directory would both answer every question (each
    record twice) and time each other's load.

    A directory this call created is removed again where the block fails before anything but its settings and
    lock were written (an unreachable server, a bad flag found late): an error left ``eval.json`` and ``.lock``
    behind, inside ``$FASTGATE_HOME`` for ``fastgate calibrate``.

    Raises:
        InputError: another process holds it ("``DIR`` is in use by another fastgate eval (pid N)")."""
    made = [d for d in (out_dir, *out_dir.parents) if not os.path.lexists(d)]  # what make_out_dir makes
    make_out_dir(out_dir)
    if fcntl is None:
        with _removed_if_empty_on_error(made):
            yield
        return
    path = out_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise _write_error(exc, "cannot create", path) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise InputError(f"{out_dir} is in use by another {what}"
                             + (f" (pid {holder})" if holder.isdigit() else "")
                             + ": wait for it to end, or use another --out") from None
        except OSError:  # a file system that takes no locks (ENOLCK): run unlocked
            pass
        with contextlib.suppress(OSError):  # the pid is for the message above only
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        with _removed_if_empty_on_error(made):  # under the lock: nobody else is writing there
            yield
    finally:
        os.close(fd)  # releases the lock (so does the process's end, however it ends)


@contextlib.contextmanager
def _removed_if_empty_on_error(made: list[Path]) -> Iterator[None]:
    """Within: where the block raises, remove the directories ``made`` for it (the run directory, then the parents
    made for it, innermost first, while empty) if the run directory holds nothing but its settings, its lock and an
    empty ``results.jsonl``; anything else there, records above all, keeps it (the error is raised as it was)."""
    try:
        yield
    except BaseException:
        if made:
            with contextlib.suppress(OSError):  # left as it is: the error being raised is the one to report
                out_dir, own = made[0], {"eval.json", LOCK_FILE, "results.jsonl"}
                entries = list(out_dir.iterdir())
                if all(p.name in own and p.is_file() and (p.name != "results.jsonl" or p.stat().st_size == 0)
                       for p in entries):
                    for p in entries:
                        p.unlink()
                    for d in made:
                        d.rmdir()  # OSError where not empty (another run's there now): the rest is left too
        raise


def _write_error(exc: OSError, what: str, path: Path) -> OSError:
    """``exc`` as the :class:`WriteError` naming ``path`` when the disk is full or not writable, else itself."""
    return disk_error(exc, what, path) or exc


def replace_file(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` to a temporary file beside ``path`` (same suffix), then rename it to ``path``: a failed write
    leaves the file as it was."""
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _write_error(exc, "cannot write", path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_figure(fig, path: str | Path) -> Path:
    """Save a matplotlib ``fig`` to ``path`` through :func:`replace_file` and close it; the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        replace_file(path, fig.savefig)
    finally:
        plt.close(fig)
    return path


def _score(record: dict[str, Any], answers: Sequence[str]) -> None:
    answer = record.get("answer") or ""
    record.update({"em": exact_match(answer, answers), "f1": token_f1(answer, answers),
                   "acc": accuracy(answer, answers)})


def _record(run: RunSpec, ex: QAExample, base: dict[str, Any], latency_s: float, batch: int) -> dict[str, Any]:
    rec = {"run": run.key, "id": ex.id, **base, "method": run.method, "question": ex.question,
           "answers": list(ex.answers), "latency_s": latency_s, "batch_size": batch}
    _score(rec, ex.answers)
    return rec


def _answer_batch(method, run: RunSpec, batch: list[QAExample], model: str) -> list[dict[str, Any]]:
    """Answer one batch; if the method rejects it, answer the questions one by one and record the rejected ones."""
    from fastgate.serving.runtime import result_record

    t0 = time.perf_counter()
    try:
        results = method.answer_batch([ex.question for ex in batch])
    except InputError:  # a question the method rejects (too long, ...): find it, keep the others
        if len(batch) == 1:
            raise
        return [rec for ex in batch for rec in _answer_one(method, run, ex, model)]
    latency = time.perf_counter() - t0
    return [_record(run, ex, result_record(r, model, run.retriever), latency, len(batch))
            for ex, r in zip(batch, results)]


def _answer_window(method, run: RunSpec, todo: Sequence[QAExample], window: int, model: str,
                   emit: Callable[[list[dict[str, Any]]], None]) -> None:
    """Answer ``todo`` with ``window`` questions in flight on one scheduler: a question joins as soon as one ends
    (as a server's closed-loop clients keep it busy), so no question waits for the slowest of a batch, and a gated
    method's questions that read and those that do not keep the engine's batch full together.

    Records are handed to ``emit`` once at least ``window`` have ended (the unit an interrupted run resumes from), in
    the order their questions ended. A record's ``latency_s`` is its own question's time from joining to its answer;
    ``wall_s`` its share of the run's wall time: its group's time from the previous group's end over the group's
    answered records (a record with an error gets 0: :func:`summarize` counts answered questions), so that a run's
    seconds per question sum each second once. A question the method rejects is answered again alone and recorded
    with its error if it fails alone too (:func:`_answer_one`), as a batch's are. A question a remote engine's server
    fails (:class:`~fastgate.errors.RemoteError`: a timeout, a 5xx after the retries) is not recorded and the others
    go on; the run then ends with one :class:`~fastgate.errors.RemoteError` naming them (a rerun retries them). On
    another error or an interrupt, the records already ended are stored before it propagates."""
    from fastgate.scheduler import Scheduler
    from fastgate.serving.runtime import result_record

    sched = Scheduler(method.engine)
    queue = list(reversed(todo))  # popped from the end: input order
    live: dict[Any, tuple[QAExample, float]] = {}  # task -> (question, when it joined)
    chunk: list[dict[str, Any]] = []
    failed: list[tuple[QAExample, RemoteError]] = []  # questions a remote engine's server did not answer
    since = time.perf_counter()

    def flush() -> None:
        nonlocal chunk, since
        now = time.perf_counter()
        group, chunk = chunk, []  # taken first: an error inside emit does not store the group twice
        answered = sum("error" not in rec for rec in group)
        for rec in group:
            rec["wall_s"] = 0.0 if "error" in rec else (now - since) / answered
            rec["batch_size"] = len(group)
        emit(group)
        since = now

    try:
        while queue or live:
            while queue and len(live) < window:
                ex = queue.pop()
                try:
                    (question,) = method.validate([ex.question])
                except InputError:
                    chunk.extend(_answer_one(method, run, ex, model))  # recorded with its error
                    continue
                live[sched.submit(method, question)] = (ex, time.perf_counter())
            if live:
                sched.step()
            for task in [t for t in live if t.done]:
                ex, t0 = live.pop(task)
                if task.error is None:
                    chunk.append(_record(run, ex, result_record(task.result, model, run.retriever),
                                         time.perf_counter() - t0, 1))
                elif isinstance(task.error, InputError):  # e.g. a prompt too long: alone, as a batch's rejected ones
                    chunk.extend(_answer_one(method, run, ex, model))
                elif isinstance(task.error, RemoteError):  # the server failed this one: the others go on
                    failed.append((ex, task.error))
                else:
                    raise task.error
            if len(chunk) >= window or (chunk and not queue and not live):
                flush()
    except BaseException:
        if chunk:  # what ended before the error or the interrupt is kept
            flush()
        raise
    if failed:  # not recorded: a rerun of the same command asks the server again for these only
        ex, first = failed[0]
        raise RemoteError(f"{len(failed)} of {len(todo)} questions of {run.key} got no answer from the server (the "
                          f"first, {ex.id}: {first}); the others are recorded: rerun the same command to retry these")


def _answer_one(method, run: RunSpec, ex: QAExample, model: str) -> list[dict[str, Any]]:
    try:
        return _answer_batch(method, run, [ex], model)
    except InputError as exc:
        base = {"answer": "", "error": str(exc), "retrieved": False, "retrieval_calls": 0, "lm_calls": 0,
                "generated_tokens": 0, "passages": [], "gate_steps": [], "timings": {}, "model": model,
                "retriever": run.retriever}
        return [_record(run, ex, base, 0.0, 1)]


def _check_params(store: ResultsStore, run: RunSpec, params: dict[str, Any], inert: frozenset[str] = frozenset()
                  ) -> None:
    """Refuse to resume or summarise ``run`` over records made with other parameter values (a recalibration, a
    changed default), except ``inert`` ones (the method's :meth:`~fastgate.methods.base.Method.inert_parameters`)."""
    for (key, qid), rec in store.records.items():
        if key != run.key or "params" not in rec:
            continue
        # records written before they kept the whole config hold only the calibrated values: compare what both name
        changed = sorted(k for k in set(params) & set(rec["params"]) - inert if params[k] != rec["params"][k])
        if changed:
            was = ", ".join(f"{k}={rec['params'].get(k)}" for k in changed)
            now = ", ".join(f"{k}={params.get(k)}" for k in changed)
            raise InputError(f"{store.path}: the records of run {run.key!r} (e.g. question {qid}) were made with "
                             f"{was}, but this run would use {now} (calibrated values or defaults changed?): evaluate "
                             f"into a new --out directory, or name the values with --param (a run of its own)")


def _other_value(store: ResultsStore, run: RunSpec | None, field: str, value: str, legacy: str | None
                 ) -> tuple[str, str, str] | None:
    """The first record of ``run`` (None: of any run) made with another ``field`` than ``value`` (records without the
    field count as ``legacy``): its run key, question id and value; None when every record agrees."""
    for (key, qid), rec in store.records.items():
        if (run is None or key == run.key) and rec.get(field, legacy) != value:
            return key, qid, rec.get(field, legacy)
    return None


def _check_dtype(store: ResultsStore, run: RunSpec, dtype: str, legacy: str) -> None:
    """Refuse to resume or summarise ``run`` over records made with the weights in another dtype (bf16 answers differ
    from float32 ones). Records written before they named their dtype count as ``legacy``."""
    if other := _other_value(store, run, "dtype", dtype, legacy):
        _, qid, was = other
        raise InputError(f"{store.path}: the records of run {run.key!r} (e.g. question {qid}) were made with the "
                         f"weights in {was}, but this run would use {dtype}: evaluate into a new --out directory, or "
                         f"pass --dtype {was}")


def _check_questions(store: ResultsStore, run: RunSpec, examples: Sequence[QAExample]) -> None:
    """Refuse to resume or summarise ``run`` where a record's id now names another question (a ``--data`` file edited
    since: ids default to line numbers, so a line inserted above shifts them), or where its question's gold answers
    changed (a corrected answer: the record was scored against the old ones)."""
    for ex in examples:
        rec = store.records.get((run.key, ex.id))
        if rec is None:
            continue
        if rec.get("question") not in (None, ex.question):
            raise InputError(f"{store.path} answered id {ex.id} of {run.key} for the question {rec['question']!r}, "
                             f"but the data now has {ex.question!r} under that id (the data changed since): evaluate "
                             "into a new --out directory")
        golds = rec.get("answers")
        if isinstance(golds, list) and set(map(str, golds)) != set(ex.answers):  # any one counts: order is no change
            raise InputError(f"{store.path} scored question {ex.id} of {run.key} against the gold answers {golds!r}, "
                             f"but the data now gives {list(ex.answers)!r} (the data changed since): evaluate into a "
                             "new --out directory")


def _corpus(runtime, run: RunSpec) -> str | None:
    """The fingerprint of the corpus ``run`` searches (its retrievers' indexes; None: it searches none, or a remote
    or test runtime without an index of its own)."""
    from fastgate.methods import METHODS
    from fastgate.retrieval import corpus_fingerprint_of

    kinds = sorted({run.retriever, *METHODS[run.method].uses_retrievers} - {None})
    if not kinds or not hasattr(runtime, "index"):
        return None
    prints = {corpus_fingerprint_of(runtime.index, kind) for kind in kinds} - {None}
    return ",".join(sorted(prints)) or None


def _check_corpus(store: ResultsStore, run: RunSpec, corpus: str | None) -> None:
    """Refuse to resume ``run`` over records that searched another corpus (``--index`` of another one). Records from
    before they named it are not checked."""
    if corpus is not None and (other := _other_value(store, run, "corpus", corpus, legacy=corpus)):
        _, qid, was = other
        raise InputError(f"{store.path}: the records of run {run.key!r} (e.g. question {qid}) searched another "
                         f"corpus (fingerprint {str(was)[:12]}; this index's {corpus[:12]}): evaluate into a new "
                         "--out directory, or pass the --index they searched")


def _check_weights(store: ResultsStore, run: RunSpec, weights: str) -> None:
    """Refuse to resume or summarise ``run`` over records made with the linear weights held otherwise (``int8``
    answers differ from ``float`` ones). Records written before they named it were made with ``float`` weights."""
    if other := _other_value(store, run, "weights", weights, "float"):
        _, qid, was = other
        raise InputError(f"{store.path}: the records of run {run.key!r} (e.g. question {qid}) were made with {was} "
                         f"weights, but this run would use {weights}: evaluate into a new --out directory, or pass "
                         f"--weights {was}")


def _check_schedule(store: ResultsStore, run: RunSpec, schedule: str) -> None:
    """Refuse to resume ``run`` under another schedule than its records' (their seconds per question and latencies
    are measured differently). Records written before they named it were answered in batches."""
    if other := _other_value(store, run, "schedule", schedule, "batches"):
        _, qid, was = other
        raise InputError(f"{store.path}: the records of run {run.key!r} (e.g. question {qid}) were answered with "
                         f"--schedule {was}, but this run would use {schedule}: pass --schedule {was}, or evaluate "
                         "into a new --out directory")


def _check_in_flight(store: ResultsStore, run: RunSpec, batch_size: int) -> None:
    """Refuse to resume ``run`` under another ``--batch-size`` than its records' (``in_flight``), as under another
    schedule: its seconds per question would average two settings, and the summary's header could name neither.
    Records written before they named it are not checked."""
    if other := _other_value(store, run, "in_flight", batch_size, batch_size):
        _, qid, was = other
        raise InputError(f"{store.path}: the records of run {run.key!r} (e.g. question {qid}) were answered with "
                         f"--batch-size {was}, but this run would use {batch_size}: pass --batch-size {was}, or "
                         "evaluate into a new --out directory")


def schedule_line(records: Iterable[dict[str, Any]]) -> str:
    """How ``records`` reached the engine, for a summary's header: ``window 32`` (``--schedule window --batch-size
    32``) or ``batch 16``; where runs were answered otherwise, each way with its runs (``window 3 (never, dtr) and
    batch 32 (always)``). Records from before they named their ``--batch-size`` (``in_flight``) say ``window`` alone
    (a record's ``batch_size`` is its group's size, not the window's) and, answered in batches, the largest batch;
    "" without records."""
    ways: dict[tuple[str, int | None], dict[str, None]] = {}
    largest: dict[str, int] = {}  # a legacy run answered in batches: its largest batch
    for rec in records:
        schedule = rec.get("schedule", "batches")  # records without one were answered in batches (_check_schedule)
        size = rec.get("in_flight")
        if size is None and schedule == "batches":
            largest[rec["run"]] = max(largest.get(rec["run"], 0), int(rec.get("batch_size") or 0))
            continue
        ways.setdefault((schedule, size), {})[rec["run"]] = None
    for run, size in largest.items():
        ways.setdefault(("batches", size or None), {})[run] = None
    words = {key: ("window" if key[0] == "window" else "batch") + ("" if key[1] is None else f" {key[1]}")
             for key in ways}
    if len(ways) == 1:
        return next(iter(words.values()))
    return " and ".join(f"{words[key]} ({', '.join(runs)})" for key, runs in ways.items())


def _check_engine(store: ResultsStore, run: RunSpec, engine: str) -> None:
    """Refuse to resume or summarise ``run`` over records made on another engine (the local model, or another
    server / model behind ``--engine openai``). Records written before they named their engine were made locally."""
    if other := _other_value(store, run, "engine", engine, "local"):
        _, qid, was = other
        raise InputError(f"{store.path}: the records of run {run.key!r} (e.g. question {qid}) were made on the "
                         f"engine {was}, but this run would use {engine}: evaluate into a new --out directory")


def _form_of(runtime) -> tuple[str | None, str | None, str | None, str]:
    """What records name of ``runtime``'s engine: ``(dtype, legacy dtype, weights, engine)``. The dtype and weights
    are None on a remote engine (the server's are not known here); the legacy dtype is what records from before they
    named it were made in: the old ``auto``, float32 on a CPU and bf16 on CUDA (None where the dtype is not known: a
    remote engine's device flag names no device here)."""
    from fastgate.assets.models import resolve_device

    dtype = runtime.dtype_name
    legacy = None if dtype is None else ("bfloat16" if resolve_device(runtime.device).type == "cuda" else "float32")
    weights = getattr(runtime, "weights_name", None)  # float, int8, int4... (None on a remote engine)
    engine = getattr(runtime, "engine_name", "local")
    return dtype, legacy, weights, engine


def _model_of(runtime) -> tuple[str | None, str]:
    """The model name ``runtime``'s records carry, known without loading it (a resumed, finished evaluation loads
    nothing, and a remote one needs no server), and the flag that names it."""
    remote = getattr(runtime, "remote", None)
    if remote is not None:
        return remote.model, "--api-model"
    spec = getattr(runtime, "model", None)
    if isinstance(spec, str):
        from fastgate.assets.models import loaded_name

        return loaded_name(spec), "--model"
    return getattr(runtime, "model_name", None), "--model"  # a stand-in runtime


def check_form(store: ResultsStore, runtime) -> None:
    """Refuse to add to or summarise ``store`` when any of its records (any run's, any question's) was made by another
    model, on another engine, with the weights in another dtype or held otherwise than ``runtime`` would make them:
    one output directory holds the records of one model, engine, dtype and weights, so that its table compares like
    with like (a float32 run beside bf16 ones timed and answered differently). Records that name none count as made
    locally, in the legacy dtype (:func:`_form_of`) with float weights, as :func:`evaluate`'s checks of one run
    count them.

    Raises:
        InputError: naming a run and question of the other form, and the flag that gives it."""
    dtype, legacy, weights, engine = _form_of(runtime)
    model, flag = _model_of(runtime)
    # the model first: eval.json names it, but records copied or left without it (eval.json lost) were adopted by
    # another model's evaluation, whose table then showed them under its name
    checks = [("model", model, model, "by the model {}", f", or pass {flag} {{}}")] if model else []
    checks.append(("engine", engine, "local", "on the engine {}", ""))
    if dtype is not None:
        checks.append(("dtype", dtype, legacy, "with the weights in {}", ", or pass --dtype {}"))
    if weights is not None:
        checks.append(("weights", weights, "float", "with {} weights", ", or pass --weights {}"))
    for field, value, old, made, flag in checks:
        if other := _other_value(store, None, field, value, old):  # the per-run checks' test, over every run
            key, qid, was = other
            raise InputError(f"{store.path} holds records made {made.format(was)} (run {key!r}, e.g. question "
                             f"{qid}), but this evaluation would use {value}: one --out holds the records of one "
                             f"model, engine, dtype and weights; evaluate into a new --out directory"
                             f"{flag.format(was)}")


def evaluate(runtime, runs: Sequence[RunSpec], examples: Sequence[QAExample], store: ResultsStore,
             batch_size: int = 16, progress: bool = True,
             on_batch: Callable[[RunSpec, int], None] | None = None,
             invocation: str | None = None, schedule: str = "window", timed: bool = True) -> list[RunSummary]:
    """Answer ``examples`` with every run, skipping (run, question) pairs already in ``store``.

    Every run is checked against the records of ``store`` (its parameters, engine, dtype, weights, questions and gold
    answers, corpus; a run with questions left, its schedule and batch size too) before any question is answered, a
    finished run's too. Where a remote engine's server fails some of a run's questions, the later runs go on (unless
    none of that run's got an answer: the server is down) and one :class:`~fastgate.errors.RemoteError` naming the
    runs is raised at the end (their other records are stored; a rerun asks for the missing ones).

    Args:
        runtime: a :class:`~fastgate.serving.runtime.Runtime` (model loaded once for all runs).
        runs: the configurations to evaluate, in order.
        examples: the questions.
        store: where records go, one batch (or chunk of ``batch_size`` answered questions) at a time.
        batch_size: questions in flight (``window``), or per ``answer_batch`` call (``batches``).
        progress: show a progress bar per run.
        on_batch: called after each stored batch with the run and the number of questions stored so far (tests
            use it to interrupt a run).
        invocation: an id of this invocation (``fastgate eval`` makes one per call), stored in every new record as
            ``invocation``: the report says whether a run's seconds per question were measured in one sitting.
        schedule: ``window`` (default): ``batch_size`` questions in flight, a new one joining as one ends
            (:func:`_answer_window`); ``batches``: batches one after another, each waiting for its slowest question
            (the schedule before 2026-11-26). Each record names it.
        timed: the run's timings are reported, so a resume under another schedule than its records' is refused, and
            a run with questions left first answers one of them untimed and unrecorded (:func:`_warm_up`); False for
            passes whose records are read for their answers only (training, calibration).

    Returns:
        One :class:`RunSummary` per run over ``examples``.
    """
    from fastgate.methods import make_config
    from fastgate.methods.base import method_class
    from fastgate.serving.runtime import AnswerRequest

    if batch_size < 1:
        raise InputError(f"batch size must be >= 1, got {batch_size}")
    if schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    # every record names the weights' dtype, format and engine, and a resume under others is refused
    dtype, legacy, weights, engine = _form_of(runtime)
    # every run is checked against the store before any question is answered: a refusal of the second run after the
    # first had answered its questions left records of the refused settings in the directory
    prepared = []
    for run in runs:
        request = AnswerRequest(run.method, run.retriever, run.params)
        # a run's key names only the user's parameters; the calibrated values and paper defaults under them can change
        # between versions, so each record keeps the whole config it was made with and a resume under another is refused
        config = make_config(run.method, runtime.effective_params(request))  # typed: "0.84" (CLI) and 0.84 are equal
        values = {f.name: getattr(config, f.name) for f in fields(config)}
        params = json.loads(json.dumps(values, sort_keys=True, default=str))
        _check_params(store, run, params, method_class(run.method).inert_parameters(config))
        _check_engine(store, run, engine)
        if timed and any(not store.done(run.key, ex.id) for ex in examples):  # a finished run is only summarised
            _check_schedule(store, run, schedule)
            _check_in_flight(store, run, batch_size)
        if dtype is not None:
            _check_dtype(store, run, dtype, legacy)
        if weights is not None:
            _check_weights(store, run, weights)
        _check_questions(store, run, examples)
        _check_corpus(store, run, _corpus(runtime, run))  # the index's manifest: a finished run's records too
        prepared.append((run, config, params))
    summaries = []
    unanswered: list[tuple[RunSpec, RemoteError]] = []  # runs whose server failed some questions
    for run, config, params in prepared:
        todo = [ex for ex in examples if not store.done(run.key, ex.id)]
        if todo:
            request = AnswerRequest(run.method, run.retriever, run.params, config)
            method = runtime.build(request)  # built once
            corpus = _corpus(runtime, run)  # read once the method has opened (or built) its indexes
            _check_corpus(store, run, corpus)
            if timed:  # the engine's and the method's first-use work is not charged to the run's first questions
                _warm_up(runtime, request, todo, schedule)
            bar = _progress(len(examples), len(examples) - len(todo), run.key, progress)
            stored = len(examples) - len(todo)
            try:
                # in_flight: --batch-size (questions in flight, or per batch); a record's batch_size is its group's
                tags = {"params": params, "engine": engine, "schedule": schedule, "in_flight": batch_size,
                        **({"corpus": corpus} if corpus is not None else {}),
                        **({"dtype": dtype} if dtype is not None else {}),
                        **({"weights": weights} if weights is not None else {}),
                        **({"invocation": invocation} if invocation is not None else {})}

                def emit(records: list[dict[str, Any]], tags=tags, bar=bar, run=run) -> None:  # bound: this run's
                    nonlocal stored
                    store.append([{**rec, **tags} for rec in records])
                    stored += len(records)
                    if bar is not None:
                        bar.update(len(records))
                    if on_batch is not None:
                        on_batch(run, stored)

                if schedule == "window":
                    _answer_window(method, run, todo, batch_size, runtime.model_name, emit)
                else:
                    for start in range(0, len(todo), batch_size):
                        emit(_answer_batch(method, run, todo[start:start + batch_size], runtime.model_name))
            except RemoteError as exc:  # the server failed some of this run's questions (the others are recorded)
                unanswered.append((run, exc))
                if stored == len(examples) - len(todo):  # none answered: the server is down, the next runs too
                    break
                continue  # the next runs go on (they stopped here): the error is raised once they are done
            finally:
                if bar is not None:
                    bar.close()
        summaries.append(summarize(run, [store.records[(run.key, ex.id)] for ex in examples]))
    if unanswered:  # not recorded: a rerun of the same command asks the server again for these only
        if len(unanswered) == 1:
            raise unanswered[0][1]
        runs_named = ", ".join(run.key for run, _ in unanswered)
        raise RemoteError(f"{len(unanswered)} runs ({runs_named}) have questions the server did not answer (the "
                          f"first: {unanswered[0][1]})")
    return summaries


def _warm_up(runtime, request, todo: Sequence[QAExample], schedule: str) -> None:
    """Answer the first of ``todo``'s questions that the method takes once, untimed and unrecorded, as ``fastgate
    serve`` warms up before its first request: the first passes of an engine (and of a method on it) pay one-time
    work (oneDNN's reordered weights, the quantized kernels' tiles, the few-shot block's cached prefix, the indexes'
    first reads) that the first run of an invocation was charged alone (``never`` timed 0.235 s a question first,
    0.020 s after ``always``). The answer comes from a method built for it and dropped: a gate that keeps state
    (the read gate's estimate of the answerable share) starts the run as it would have without it. A question the
    method or the server fails is left to the run, which says its own errors."""
    from fastgate.scheduler import Scheduler

    method = runtime.build(request)
    for ex in todo:
        try:
            method.validate([ex.question])
        except InputError:  # too long, ...: recorded with its error by the run; another warms up
            continue
        try:
            if schedule == "window":
                Scheduler(method.engine).answer(method, [ex.question])
            else:
                method.answer_batch([ex.question])
        except (InputError, RemoteError):
            pass
        method.engine.finish_warm_up()  # the products' probes for more rows than one question's passes had
        return


def _progress(total: int, done: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc=desc, unit="q", dynamic_ncols=True)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


SLOW_FACTOR = 10.0  # a question's time this many times its run's median: not the work, the machine (RunSummary)


def summarize(run: RunSpec, records: Sequence[dict[str, Any]]) -> RunSummary:
    """Aggregate the records of one run (each batch's time is counted once: records carry their batch size)."""
    n = len(records)
    if n == 0:
        raise InputError(f"run {run.key} has no records to summarise")

    def mean(key: str) -> float:
        return sum(float(r.get(key) or 0) for r in records) / n

    def se(key: str) -> float:
        if n < 2:
            return float("nan")
        m = mean(key)
        return math.sqrt(sum((float(r.get(key) or 0) - m) ** 2 for r in records) / (n - 1) / n)

    ok = [r for r in records if "error" not in r]
    # a record's share of the run's wall time: its own (windowed runs), else its batch's time over the batch
    walls = [r["wall_s"] if "wall_s" in r else r["latency_s"] / r["batch_size"] for r in ok]
    wall = sum(walls)
    typical = _percentile(walls, 0.5)
    slow = sum(w for w in walls if w > SLOW_FACTOR * typical) if typical > 0 else 0.0
    answer_s = sum(r["timings"].get("total_s", 0.0) / r["batch_size"] for r in ok)
    gate_s = sum(r["timings"].get("gate_s", 0.0) / r["batch_size"] for r in ok)
    latencies = [r["latency_s"] for r in ok]
    return RunSummary(
        run=run.key, method=run.method, n=n, em=mean("em"), f1=mean("f1"), acc=mean("acc"),
        retrieval_rate=sum(decision(r) for r in records) / n,  # the coins' own rule, one definition of a read
        retrievals_per_q=mean("retrieval_calls"), lm_calls_per_q=mean("lm_calls"),
        tokens_per_q=mean("generated_tokens"),
        latency_p50_s=_percentile(latencies, 0.5), latency_p95_s=_percentile(latencies, 0.95),
        questions_per_s=len(ok) / wall if wall > 0 else float("nan"),
        gate_share=gate_s / answer_s if answer_s > 0 else 0.0, errors=n - len(ok),
        em_se=se("em"), f1_se=se("f1"), acc_se=se("acc"),
        s_per_q=wall / len(ok) if ok and wall > 0 else float("nan"), prompt_tokens_per_q=mean("prompt_tokens"),
        # records from before they named their invocation count as one more (unknown) sitting beside named ones
        invocations=len({r.get("invocation") or "" for r in records}) if any(r.get("invocation") for r in records)
        else 0,
        slow_share=slow / wall if wall > 0 else 0.0,
    )


_COLUMNS = [  # (field, header, format)
    ("run", "run", "{}"), ("n", "n", "{}"), ("em", "EM", "{:.3f}"), ("f1", "F1", "{:.3f}"), ("acc", "ACC", "{:.3f}"),
    ("acc_se", "± ACC (SE)", "{:.3f}"), ("retrieval_rate", "retrieved", "{:.0%}"),
    ("retrievals_per_q", "searches/q", "{:.2f}"),
    ("lm_calls_per_q", "LM calls/q", "{:.2f}"), ("prompt_tokens_per_q", "prompt tokens/q", "{:.0f}"),
    ("tokens_per_q", "generated tokens/q", "{:.1f}"),
    ("latency_p50_s", "latency p50 (s)", "{:.2f}"), ("latency_p95_s", "latency p95 (s)", "{:.2f}"),
    ("questions_per_s", "q/s", "{:.2f}"), ("s_per_q", "s/question", "{:.3f}"), ("gate_share", "gate time", "{:.2%}"),
    ("errors", "errors", "{}"),
]


def markdown_table(summaries: Sequence[RunSummary]) -> str:
    head = "| " + " | ".join(h for _, h, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" if f == "run" else "---:" for f, _, _ in _COLUMNS) + "|"
    rows = ["| " + " | ".join(fmt.format(getattr(s, f)) for f, _, fmt in _COLUMNS) + " |" for s in summaries]
    return "\n".join([head, rule, *rows]) + "\n"


def write_summary(out_dir: str | Path, summaries: Sequence[RunSummary], stem: str = "summary",
                  header: str = "", sections: Sequence[str] = ()) -> tuple[Path, Path]:
    """Write ``stem.md`` (a header line, the table, then ``sections``: markdown, each after a blank line) and
    ``stem.csv``; returns both paths."""
    out = Path(out_dir)
    md, cs = out / f"{stem}.md", out / f"{stem}.csv"
    text = (header + "\n\n" if header else "") + markdown_table(summaries) + "".join("\n" + s for s in sections)
    replace_file(md, lambda tmp: tmp.write_text(text))

    def write_csv(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(RunSummary.__dataclass_fields__))
            w.writeheader()
            for s in summaries:
                w.writerow(asdict(s))

    replace_file(cs, write_csv)
    return md, cs


def plot_accuracy_vs_retrieval(summaries: Sequence[RunSummary], path: str | Path, title: str,
                               line: bool = False, labels: Sequence[str] | None = None) -> Path:
    """Accuracy (ACC) against retrieval rate, one labelled point per run; ``line`` joins the points (a sweep).

    ``labels`` name the points (default: the run names); long run names go in a note under the axes instead."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'fastgate[eval]'") from None
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    xs = [s.retrieval_rate for s in summaries]
    ys = [s.acc for s in summaries]
    if line:
        pts = sorted(zip(xs, ys))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color="0.6", zorder=1)
    ax.scatter(xs, ys, zorder=2)
    errs = [s.acc_se for s in summaries]
    if all(e == e for e in errs):  # standard errors known (not NaN): ±1 SE bars
        ax.errorbar(xs, ys, yerr=errs, fmt="none", ecolor="0.5", elinewidth=0.8, capsize=2, zorder=1)
    names = list(labels) if labels is not None else [s.run for s in summaries]
    for name, x, y in zip(names, xs, ys):
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8, annotation_clip=False)
    long = [s.run for s, name in zip(summaries, names) if s.run != name]
    if long:
        fig.text(0.01, 0.01, "runs: " + "; ".join(long), fontsize=6, wrap=True)
    ax.set_xlabel("questions that retrieved")
    ax.set_ylabel("accuracy (ACC)")
    ax.set_xlim(-0.05, 1.05)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.06 if long else 0, 1, 1))
    return save_figure(fig, path)
