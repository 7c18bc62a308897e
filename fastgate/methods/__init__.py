"""Methods: the papers' pipelines on top of the engine, gates and retrievers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fastgate.errors import InputError, UnknownNameError
from fastgate.methods.base import Method, MethodConfig, MethodResult
from fastgate.methods.cbdr import Cbdr, CbdrConfig
from fastgate.methods.dtr import Dtr, DtrConfig
from fastgate.methods.flare import Flare, FlareConfig
from fastgate.methods.probing import Probing, ProbingConfig
from fastgate.methods.read import Read, ReadConfig
from fastgate.methods.scaar import Scaar, ScaarConfig
from fastgate.methods.seakr import Seakr, SeakrConfig
from fastgate.methods.simple import AlwaysRetrieve, NeverRetrieve

__all__ = [
    "METHODS",
    "AlwaysRetrieve",
    "Cbdr",
    "CbdrConfig",
    "Dtr",
    "DtrConfig",
    "Flare",
    "FlareConfig",
    "Method",
    "MethodConfig",
    "MethodResult",
    "NeverRetrieve",
    "Probing",
    "ProbingConfig",
    "Read",
    "ReadConfig",
    "Scaar",
    "ScaarConfig",
    "Seakr",
    "SeakrConfig",
    "build_method",
    "check_parameter_names",
    "make_config",
]

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (NeverRetrieve, AlwaysRetrieve, Flare, Probing, Dtr, Seakr, Scaar, Cbdr, Read)
}


def check_parameter_names(method: str, names, hidden=(), valid: str = "valid") -> None:
    """Refuse parameter ``names`` that ``method`` (a known one) does not have, listing under ``valid`` the ones it
    has less ``hidden`` (a server's operator-locked parameters are not a request's to set).

    Raises:
        InputError: naming the unknown ones."""
    fields = {f.name for f in dataclasses.fields(METHODS[method].config_class)}
    unknown = sorted(set(names) - fields)
    if unknown:
        raise InputError(f"unknown parameter(s) for {method}: {', '.join(unknown)}; {valid}: "
                         f"{', '.join(sorted(fields - set(hidden)))}")


def make_config(method: str, params: dict[str, Any] | None = None) -> MethodConfig:
    """Build a method's typed config from ``name=value`` parameters (strings are converted to the field's type)."""
    if method not in METHODS:
        raise UnknownNameError("method", method, list(METHODS))
    cls = METHODS[method].config_class
    params = params or {}
    if not isinstance(params, Mapping):  # a list reached .items() as an AttributeError
        raise InputError(f"parameters are name=value pairs (a mapping), got {type(params).__name__}")
    check_parameter_names(method, params)
    return cls(**params)  # MethodConfig.__post_init__ types every field (coerce_param): "0.84" (CLI) is 0.84


def build_method(name: str, engine, retriever=None, params: dict[str, Any] | None = None,
                 retrievers: dict[str, Any] | None = None, config: MethodConfig | None = None) -> Method:
    """Construct method ``name`` with its config built from ``params``, or with ``config``, one already built by
    :func:`make_config` (``retrievers``: the other retrievers a method searches besides its own, by kind, for methods
    with ``uses_retrievers``)."""
    if name not in METHODS:  # with a config too: a bare KeyError before
        raise UnknownNameError("method", name, list(METHODS))
    if config is None:
        config = make_config(name, params)
    elif params or not isinstance(config, METHODS[name].config_class):
        raise InputError(f"build_method takes params or a {METHODS[name].config_class.__name__}, not both")
    if METHODS[name].uses_retrievers:
        return METHODS[name](engine, retriever, config, retrievers=retrievers)
    return METHODS[name](engine, retriever, config)
