"""``--param name=value`` parsing, shared by the CLI commands that take method parameters.

Owns the one helper :func:`parse_params`; imported by :mod:`fastgate.entrypoints.cli` (ask, eval, serve) and
:mod:`fastgate.train.calibrate`, so that neither imports the other for it. Calls nothing but :mod:`fastgate.errors`.
"""

from __future__ import annotations

from fastgate.errors import InputError

__all__ = ["parse_params"]


def parse_params(items: list[str] | None) -> dict[str, str]:
    """``["name=value", ...]`` (repeated ``--param`` flags) -> ``{name: value}``, both stripped; later names win.

    Raises:
        InputError: an item without ``=``.
    """
    params: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise InputError(f"--param expects name=value, got {item!r}")
        key, value = item.split("=", 1)
        params[key.strip()] = value.strip()
    return params
