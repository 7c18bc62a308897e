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

import json
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
    "user_calibration_file",
    "write_calibration",
]

SHIPPED = Path(__file__).resolve().parents[1] / "calibrations"


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text())
        entries = doc["entries"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "method" in e and "params" in e
                                                    for e in entries):
            raise ValueError("entries must be a list of {method, params, ...}")
        return entries
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"calibration file {path} is corrupt ({exc}): fix or delete it, or rerun "
                         f"`fastgate calibrate`") from None


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
    """Where ``fastgate calibrate`` writes the model's calibration (under ``$FASTGATE_HOME``)."""
    from fastgate.assets.paths import home

    return home() / "calibration" / f"{model_name}.json"


def calibration_entries(model_name: str) -> list[dict[str, Any]]:
    """The shipped entries of ``model_name``, then the user's (later entries win)."""
    return list(_SHIPPED_ENTRIES.get(model_name, [])) + _read(user_calibration_file(model_name))


def _applies(entry: dict[str, Any], method: str, params: dict[str, Any]) -> bool:
    if entry["method"] != method:
        return False
    when = entry.get("when") or {}
    if not when:
        return True
    from fastgate.methods.base import method_class  # the interface, not the methods table (which lists read)

    cls = method_class(method)
    defaults = cls.parameters() if cls is not None else {}
    return all(params.get(k, defaults.get(k)) == v for k, v in when.items())


def calibrated_params(model_name: str, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """``params`` on top of the calibrated values for (model, method); user values win."""
    params = dict(params or {})
    merged = dict(CALIBRATED.get(model_name, {}).get(method, {}))
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
    for entry in _read(user_calibration_file(model_name)):
        if _applies(entry, method, params):
            merged.update(entry["params"])
    merged.update(params)
    return merged


def write_calibration(model_name: str, entry: dict[str, Any], path: Path | None = None) -> Path:
    """Add ``entry`` to the user's calibration file of ``model_name`` (replacing one with the same method and
    ``when``), atomically."""
    path = path or user_calibration_file(model_name)
    entries = [e for e in _read(path)
               if not (e["method"] == entry["method"] and (e.get("when") or {}) == (entry.get("when") or {}))]
    doc = {"model": model_name, "entries": entries + [entry]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


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
