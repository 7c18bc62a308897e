"""Per-model calibrated gate thresholds: one JSON format, shipped and written by ``fastgate calibrate``.

Method configs default to the papers' values, which were tuned on 2B–72B models. A small model is far less certain
even when right, so its thresholds are calibrated on dev questions and applied whenever the user does not set the
parameter (``--paper-defaults`` turns this off).

A calibration file ``<model>.json`` holds ``entries``: ``{"method", "params", "when" (optional), "note", ...}``; an
entry applies to a request of ``method`` whose parameters (given, else the config's default) equal its ``when``.
The shipped files are ``fastgate/calibrations/<model>.json`` (their notes say how each value was found);
``fastgate calibrate`` writes ``$FASTGATE_HOME/calibration/<model>.json``, whose entries win over the shipped ones.

This module sits under the methods: it reads a method's defaults through the :class:`~fastgate.methods.base.Method`
interface (:func:`~fastgate.methods.base.method_class`), never through the methods table, which lists the read gate,
a caller of :func:`calibrated_params`.
"""

from __future__ import annotations

import functools
import json
import logging
import typing
from pathlib import Path
from typing import Any

from fastgate.errors import InputError

__all__ = [
    "CALIBRATED",
    "CPU_EVAL_BUDGET",
    "SEAKR_DELTA_BY_SAMPLES",
    "SHIPPED",
    "calibrated_params",
    "calibration_entries",
    "check_calibration_file",
    "checkpoint_key",
    "user_calibration_file",
    "write_calibration",
]

SHIPPED = Path(__file__).resolve().parents[1] / "calibrations"


def _load(path: Path) -> tuple[Any, list[dict[str, Any]]]:
    """The ``model`` field (None where absent) and the entries of the calibration file ``path`` (none where it does not
    exist).

    Raises:
        InputError: a corrupt file."""
    try:
        doc = json.loads(path.read_text())
        entries = doc["entries"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("method"), str)
                                                    and isinstance(e.get("params"), dict)
                                                    and isinstance(e.get("when") or {}, dict) for e in entries):
            raise ValueError("entries must be a list of {method: str, params: {...}, when: {...} (optional)}")
        if not isinstance(doc.get("model", ""), str):
            raise ValueError(f"model must be a model's name, got {doc['model']!r}")
    except FileNotFoundError:
        return None, []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # not "rerun `fastgate calibrate`": it reads the same file first, and stops on it the same way
        raise InputError(f"calibration file {path} is corrupt ({exc}): fix or delete it") from None
    return doc.get("model"), entries


def _read(path: Path, model: str | None = None) -> list[dict[str, Any]]:
    """The entries of the calibration file ``path`` (none where it does not exist). With ``model``, a file whose
    ``model`` field names another model is refused: its thresholds were measured on that model's scores.

    Raises:
        InputError: a corrupt file, or one of another model."""
    owner, entries = _load(path)
    if model is not None and owner is not None and owner != model:
        raise InputError(f"calibration file {path} holds {owner}'s thresholds (its \"model\"), not {model}'s: "
                         f"they were measured on {owner}'s scores; move it to {user_calibration_file(owner)}, or "
                         "delete it")
    return entries


def _shipped() -> dict[str, list[dict[str, Any]]]:
    return {p.stem: _read(p) for p in sorted(SHIPPED.glob("*.json"))}


_SHIPPED_ENTRIES = _shipped()

# Views of the shipped files (what `fastgate methods` lists): unconditional values per (model, method), and SeaKR's
# δ per sample count (its eigenscore is a mean log-eigenvalue of a k×k Gram matrix, so its scale depends on k; a
# count without its own value takes the nearest calibrated one).
CALIBRATED: dict[str, dict[str, dict[str, Any]]] = {
    model: {e["method"]: dict(e["params"]) for e in entries if not e.get("when")}
    for model, entries in _SHIPPED_ENTRIES.items()
}
SEAKR_DELTA_BY_SAMPLES: dict[str, dict[int, float]] = {
    model: {int(e["when"]["samples"]): float(e["params"]["delta"]) for e in entries
            if e["method"] == "seakr" and set(e.get("when") or {}) == {"samples"}}
    for model, entries in _SHIPPED_ENTRIES.items()
}
SEAKR_DELTA_BY_SAMPLES = {m: v for m, v in SEAKR_DELTA_BY_SAMPLES.items() if v}


def user_calibration_file(model_name: str) -> Path:
    """Where ``fastgate calibrate`` writes the model's calibration (under ``$FASTGATE_HOME``). A served model's name
    may hold ``/`` (``Qwen/Qwen2.5-0.5B-Instruct``): the file name has ``--`` there."""
    from fastgate.assets.paths import home

    return home() / "calibration" / f"{model_name.replace('/', '--')}.json"


def calibration_entries(model_name: str) -> list[dict[str, Any]]:
    """The shipped entries of ``model_name``, then the user's (later entries win)."""
    return list(_SHIPPED_ENTRIES.get(model_name, [])) + _read(user_calibration_file(model_name), model_name)


def checkpoint_key(value: Any) -> str:
    """How an entry names the checkpoint it was made for: ``""`` for the one shipped for the model (also when named
    by its path: it was refused as uncalibrated), else the directory's resolved path (so ``./ckpt`` and its absolute
    path are one checkpoint)."""
    if not value:
        return ""
    from fastgate.gates.checkpoints import DEFAULT_CHECKPOINTS

    path = Path(str(value)).expanduser().resolve()
    return "" if path.parent == DEFAULT_CHECKPOINTS else str(path)


def _defaults(method: str) -> dict[str, Any]:
    from fastgate.methods.base import method_class  # the interface, not the methods table (which lists read)

    cls = method_class(method)
    return cls.parameters() if cls is not None else {}


def _applies(entry: dict[str, Any], method: str, params: dict[str, Any]) -> bool:
    """Whether ``entry`` is for this request. A checkpoint-based gate's entry is for one checkpoint (its ``when``'s
    ``checkpoint``; none: the shipped one), so a user's own checkpoint never inherits the shipped threshold."""
    if entry["method"] != method:
        return False
    when = entry.get("when") or {}
    defaults = _defaults(method)
    if "checkpoint" in defaults and \
            checkpoint_key(when.get("checkpoint")) != checkpoint_key(params.get("checkpoint", defaults["checkpoint"])):
        return False
    # typed as the config types them (make_config's parser): `--param k=2` (written "2"), `--k 2` and 2 are one value
    return all(_typed(method, k, params.get(k, defaults.get(k))) == _typed(method, k, v)
               for k, v in when.items() if k != "checkpoint")


def _typed(method: str, name: str, value: Any) -> Any:
    """``value`` as ``method``'s config types parameter ``name`` (:func:`fastgate.methods.base.coerce_param`); as it
    is where the method has no such parameter or the value does not parse as it."""
    from fastgate.methods.base import coerce_param

    try:
        return coerce_param(name, value, _hints(method).get(name))
    except InputError:
        return value


@functools.cache
def _hints(method: str) -> dict[str, Any]:
    """The type annotations of ``method``'s config fields (none for an unknown method)."""
    from fastgate.methods.base import method_class

    cls = method_class(method)
    return typing.get_type_hints(cls.config_class) if cls is not None else {}


_WARNED: set[tuple[str, str, str]] = set()  # (model, method, checkpoint) already warned about in this process


def _uncalibrated(model_name: str, method: str, params: dict[str, Any], warn: bool) -> None:
    """No entry applies to a gated method whose threshold the user did not set: say so once per process, model,
    method and checkpoint; the read gate, whose threshold belongs to its checkpoint, refuses (a training pass,
    ``collect``, needs none)."""
    from fastgate.methods.base import method_class

    cls = method_class(method)
    spec = cls.threshold if cls is not None else None
    if spec is None or spec.param in params:
        return
    defaults = cls.parameters()
    if method == "read" and str(params.get("collect", defaults.get("collect"))).lower() in ("true", "1", "yes"):
        return  # a training pass reads every question: no threshold to miss
    ckpt = checkpoint_key(params.get("checkpoint", defaults.get("checkpoint")))
    what = f"{method} on model {model_name}" + (f" with checkpoint {ckpt}" if ckpt else "")
    conditions = " ".join(f"--param {k}={v}" for k, v in sorted(params.items()) if k != spec.param)
    command = f"`fastgate calibrate --method {method} --model {model_name}" + (f" {conditions}`" if conditions else "`")
    if method == "read":
        _check_read_checkpoint(cls, model_name, params)  # what is wrong with it first: calibrating would not cure it
        raise InputError(f"no calibrated threshold for {what} (base={params.get('base', defaults.get('base'))}, "
                         f"features={params.get('features', defaults.get('features'))}): the read gate's threshold "
                         "(the price of a read; a log-odds value for checkpoints older than the gain model) belongs "
                         f"to its checkpoint, and `fastgate train read` writes it; run {command}, or pass "
                         f"--param {spec.param}=T")
    key = (model_name, method, ckpt)
    if warn and key not in _WARNED:
        _WARNED.add(key)
        served = " (with --engine openai --base-url URL --api-model NAME for a served model)" if cls.black_box else ""
        logging.getLogger("fastgate.calibration").warning(
            "fastgate: warning: no calibration of %s: using %s=%s, the default (tuned for other models); run %s%s",
            what, spec.param, defaults.get(spec.param), command, served)


def _check_read_checkpoint(cls: Any, model_name: str, params: dict[str, Any]) -> None:
    """Refuse the read gate's checkpoint as building the gate would, before the missing calibration is named: one
    made for another model, mode or base method, or without the asked feature set (``features=dense`` over the
    shipped SmolLM2 gate, which has only ``all``), fails ``fastgate calibrate`` the same way, so pointing there led
    nowhere. What the request's own checks report (parameters that make no config, no checkpoint for the model, a
    directory without a ``config.json``) is left to them: the CLI runs them first, and they name it better."""
    from fastgate.errors import CheckpointError

    try:
        config = cls.config_class(**params)
        path = cls.checkpoint_path(config, model_name)
    except (TypeError, InputError, CheckpointError):  # unknown or ill-typed parameters; no checkpoint to check
        return
    cls.check_checkpoint(config, path, model_name)


def calibrated_params(model_name: str, method: str, params: dict[str, Any] | None = None, *,
                      warn: bool = True) -> dict[str, Any]:
    """``params`` on top of the calibrated values for (model, method); user values win.

    A gated method with no entry for the model (or for the user's own ``checkpoint``) keeps its default threshold
    and says so once per process (``warn``), except the read gate, which refuses (:class:`InputError`)."""
    params = dict(params or {})
    from fastgate.methods.base import method_class

    cls = method_class(method)
    if cls is not None and cls.threshold is None:  # never, always: no threshold, so no calibration file is read
        return params
    defaults = _defaults(method)
    shipped_checkpoint = checkpoint_key(params.get("checkpoint", defaults.get("checkpoint"))) == ""
    merged: dict[str, Any] = {}
    applied = False
    if shipped_checkpoint:  # the unconditional shipped values are the shipped checkpoints'
        merged = dict(CALIBRATED.get(model_name, {}).get(method, {}))
        applied = bool(merged)
    if method == "seakr" and "delta" in merged and model_name in SEAKR_DELTA_BY_SAMPLES:
        from fastgate.methods.seakr import SeakrConfig

        by_k = {SeakrConfig.samples: merged["delta"], **SEAKR_DELTA_BY_SAMPLES[model_name]}
        k = params.get("samples", SeakrConfig.samples)
        if isinstance(k, int):
            merged["delta"] = by_k[min(by_k, key=lambda n: (abs(n - k), n))]
    for entry in _SHIPPED_ENTRIES.get(model_name, []):  # conditional shipped entries other than SeaKR's by k
        if entry.get("when") and not (method == "seakr" and set(entry["when"]) == {"samples"}) \
                and _applies(entry, method, params):
            merged.update(entry["params"])
            applied = True
    for entry in _read(user_calibration_file(model_name), model_name):
        if _applies(entry, method, params):
            merged.update(entry["params"])
            applied = True
    if not applied:
        _uncalibrated(model_name, method, params, warn)
    merged.update(params)
    return merged


def write_calibration(model_name: str, entry: dict[str, Any], path: Path | None = None) -> Path:
    """Add ``entry`` to the user's calibration file of ``model_name`` (replacing one with the same method and
    ``when``), atomically.

    Raises:
        InputError: ``path`` is corrupt, or holds another model's calibration (:func:`check_calibration_file`); it is
            left as it is."""
    path = path or user_calibration_file(model_name)
    entries = [e for e in check_calibration_file(model_name, path)
               if not (e["method"] == entry["method"] and (e.get("when") or {}) == (entry.get("when") or {}))]
    doc = {"model": model_name, "entries": entries + [entry]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def check_calibration_file(model_name: str, path: Path) -> list[dict[str, Any]]:
    """``path`` may receive ``model_name``'s entries: absent, or a calibration file of that model (or naming none);
    its entries. Another model's file was rewritten as ``model_name``'s, its entries with it (``fastgate calibrate
    --write``).

    Raises:
        InputError: a directory, a corrupt file, or another model's (both models named)."""
    if path.is_dir():  # not "corrupt: fix or delete it"
        raise InputError(f"{path} is a directory: --write takes a calibration file (a new one, or {model_name}'s)")
    owner, entries = _load(path)
    if owner is not None and owner != model_name:
        raise InputError(f"{path} is {owner}'s calibration file, not {model_name}'s: writing {model_name}'s entry "
                         f"there would relabel {owner}'s thresholds as {model_name}'s; choose another --write (or "
                         f"leave it out: {user_calibration_file(model_name)})")
    return entries


# `fastgate eval --budget cpu` (the default without a GPU): the methods whose cost grows with a sample, candidate or
# round count run with smaller counts, so that all methods on 200 questions fit an hour of a 2-core CPU (measured:
# docs/RESULTS.md). SeaKR is decode-bound: at k=20 with 4 steps of 3 candidates it samples ~2,800 tokens per question
# (about 30 s each on that CPU) and still 16 s per question with 5 samples, 2 steps and 2 candidates; the budget keeps
# 3 samples, one gated step with 2 re-ranked candidates and a 48-token knowledge path. CBDR prefills 20 (question,
# passage) prompts per retrieving question; the shipped probers ask for retrieval again after most retrievals, so
# Probing-RAG runs 4 rounds of 5-passage prompts (~14 s per question). The values show in the run names
# (seakr[answer_tokens=48,...]).
CPU_EVAL_BUDGET: dict[str, dict[str, Any]] = {
    "probing": {"max_iterations": 1},
    "seakr": {"samples": 3, "max_steps": 1, "n_candidates": 2, "answer_tokens": 48},
    "cbdr": {"n_candidates": 5},
}
