"""Settings that carry their own command-line form: a config dataclass's field is declared once, with its default,
its help line and its choices, and the CLI flags are generated from the fields (as vLLM's ``engine/arg_utils.py``
generates its flags from its config classes), so a default or a help line is written in one place.

Owns the field metadata (``help``, ``flag``, ``choices``: :func:`setting`), the argparse flags made from it
(:func:`add_setting_args`) and the parsing of repeated ``--param name=value`` flags (:func:`parse_params`, shared by
the CLI's commands and ``fastgate calibrate``). Imports nothing of fastgate but :mod:`fastgate.errors`:
:mod:`fastgate.serving.service` and :mod:`fastgate.scheduler.config` declare their fields with it, and
:mod:`fastgate.entrypoints.cli` adds the flags of those fields to its commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from fastgate.errors import InputError

__all__ = ["add_setting_args", "count", "parse_params", "positive_count", "setting"]


def count(text: str) -> int:
    """argparse ``type`` of a ``--n`` that counts questions from the start of a seeded order: an integer >= 0 (a
    negative one sliced "all but the last N" silently)."""
    return _questions(text, 0)


def positive_count(text: str) -> int:
    """:func:`count` of a ``--n`` where 0 means nothing (no "0 = all"): an integer >= 1, so that ``--n -5`` is told
    the bound ``--n 0`` would be told."""
    return _questions(text, 1)


def _questions(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of questions, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a number of questions >= {least}, got {value}")
    return value


def setting(default: Any, help: str | None = None, *, flag: str | None = None,  # noqa: A002 - argparse's word
            choices: Iterable[str] | None = None) -> Any:
    """A dataclass field with ``default`` and what its flag shows: ``help`` (argparse's ``%(default)s`` is the field's
    default), ``flag`` (default ``--field-name``) and the ``choices`` it takes (checked by the config too)."""
    metadata: dict[str, Any] = {}
    if help is not None:
        metadata["help"] = help
    if flag is not None:
        metadata["flag"] = flag
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return dataclasses.field(default=default, metadata=metadata)


def _scalar(annotation: Any) -> Any:
    """``int`` of ``int``, ``int | None`` and ``Optional[int]``; the annotation itself otherwise."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else annotation
    return annotation


def add_setting_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, names: Iterable[str],
                     help: Mapping[str, str] | None = None,  # noqa: A002 - argparse's word
                     placeholders: Mapping[str, str] | None = None, dest_prefix: str = "") -> None:
    """Add one flag per field of dataclass ``cls`` in ``names``, in that order: its ``dest`` is the field's name, its
    default the field's, its type the field's (a ``bool`` field is a switch, ``store_true``), its help the field's
    ``help`` (or ``help[name]``) with each ``{key}`` of ``placeholders`` replaced (e.g. the method names, known only
    once the methods are imported). ``dest_prefix`` goes before each ``dest`` (two configs with a field of one name
    in one parser); a field without a default (``setting(dataclasses.MISSING, ...)``) defaults to None."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in names:
        f = fields[name]
        text = (help or {}).get(name, f.metadata.get("help"))
        for key, value in (placeholders or {}).items():
            text = text.replace("{" + key + "}", value) if text else text
        flag = f.metadata.get("flag", "--" + name.replace("_", "-"))
        kind = _scalar(hints[name])
        if kind is bool:
            if f.default is not False:
                raise TypeError(f"{cls.__name__}.{name}: a switch must default to False")
            parser.add_argument(flag, dest=dest_prefix + name, action="store_true", help=text)
            continue
        default = None if f.default is dataclasses.MISSING else f.default
        kwargs: dict[str, Any] = {"dest": dest_prefix + name, "default": default, "help": text}
        if "choices" in f.metadata:
            kwargs["choices"] = list(f.metadata["choices"])
        else:  # the flag's name, as argparse writes it (not the field's, e.g. --timeout's TIMEOUT, not TIMEOUT_S)
            kwargs["metavar"] = flag.lstrip("-").replace("-", "_").upper()
        if kind in (int, float):
            kwargs["type"] = kind
        parser.add_argument(flag, **kwargs)


def parse_params(items: list[str] | None) -> dict[str, str]:
    """``["name=value", ...]`` (repeated ``--param`` flags) -> ``{name: value}``, both stripped.

    Raises:
        InputError: an item without ``=``, or a name given twice (the later value silently won: ``--param k=2
            --param k=5`` answered with 5 passages, whichever the user meant).
    """
    params: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise InputError(f"--param expects name=value, got {item!r}")
        key, value = (part.strip() for part in item.split("=", 1))
        if key in params:
            raise InputError(f"--param {key}={params[key]} and --param {key}={value} both set {key}: give one")
        params[key] = value
    return params
