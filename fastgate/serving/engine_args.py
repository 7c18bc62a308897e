"""The ``--engine openai`` flags of every command that can generate on an OpenAI-compatible server (``ask``, ``eval``,
``serve``, ``calibrate``): generated from :class:`~fastgate.engine.remote.RemoteConfig`'s fields
(:func:`fastgate.settings.add_setting_args`, ``dest`` prefixed ``api_``), so a default or a help line is written once.

The one hand-written flag is ``--api-key-env``: the key itself never goes on a command line, so it is not a flag of
the config's ``api_key`` but the name of the environment variable that holds it.
"""

from __future__ import annotations

import argparse
import os

from fastgate.errors import InputError

__all__ = ["LOCAL_SETTINGS", "REMOTE_SETTINGS", "add_engine_args", "remote_config"]

# RemoteConfig's fields that are flags, in --help order
REMOTE_SETTINGS = ("base_url", "model", "timeout_s", "concurrency", "max_retries", "context_tokens")
_PREFIX = "api_"
# RuntimeConfig's fields that say how the local model loads (``--model --device --dtype --step --weights``, their
# defaults RuntimeConfig's): a remote engine loads none, so a value given for one would be dropped without a word
LOCAL_SETTINGS = ("model", "device", "dtype", "step", "weights")


def add_engine_args(p: argparse.ArgumentParser, black_box: list[str] | None = None) -> None:
    """The ``remote engine`` group: ``--engine``, RemoteConfig's flags and ``--api-key-env``. ``black_box``: the
    methods a remote engine runs (named in the group's description; default: from the methods table)."""
    from fastgate.engine.remote import RemoteConfig
    from fastgate.settings import add_setting_args

    if black_box is None:
        from fastgate.methods import METHODS

        black_box = [name for name, cls in METHODS.items() if cls.black_box]
    g = p.add_argument_group("remote engine", "generate on an OpenAI-compatible server (vLLM, SGLang, llama.cpp's "
                             "server, another fastgate serve) instead of a local model; only "
                             f"{', '.join(black_box[:-1])} and {black_box[-1]} run there (the others read hidden "
                             "states)")
    g.add_argument("--engine", choices=["local", "openai"], default="local",
                   help="local: the --model loaded here; openai: --base-url's /v1/completions with logprobs "
                        "(default: %(default)s)")
    add_setting_args(g, RemoteConfig, REMOTE_SETTINGS, dest_prefix=_PREFIX)
    g.add_argument("--api-key-env", default="OPENAI_API_KEY", metavar="VAR",
                   help="environment variable holding the API key, sent as a bearer token if set (default: "
                        "%(default)s; keys never go on the command line)")


def remote_config(args: argparse.Namespace):
    """The :class:`~fastgate.engine.remote.RemoteConfig` of ``--engine openai`` (None for the local engine).

    Raises:
        InputError: remote flags without ``--engine openai``, ``--engine openai`` without its URL and model, or with
            a local model's flag (``--model``, ``--device``, ``--dtype``, ``--step``, ``--weights``) set.
    """
    values = {name: getattr(args, _PREFIX + name) for name in REMOTE_SETTINGS}
    if args.engine == "local":
        if values["base_url"] is not None or values["model"] is not None:
            raise InputError("--base-url and --api-model need --engine openai")
        return None
    local = _local_flags(args)
    if local:  # before the URL's check: both are mistakes, and this one says what --api-model is for
        raise InputError(f"--engine openai loads no local model: {', '.join(local)} would be ignored (the server's "
                         "model is --api-model NAME); drop them, or use --engine local")
    if not values["base_url"] or not values["model"]:
        raise InputError("--engine openai needs --base-url URL (with its /v1) and --api-model NAME")
    from fastgate.engine.remote import RemoteConfig

    return RemoteConfig(**values, api_key=os.environ.get(args.api_key_env) or None)


def _local_flags(args: argparse.Namespace) -> list[str]:
    """The local model's flags ``args`` holds with another value than their default, as ``--flag value``.

    The defaults are :class:`~fastgate.serving.runtime.RuntimeConfig`'s, which ``ask``, ``eval``, ``serve`` and
    ``calibrate`` declare their flags with; a command without one of the flags has no attribute for it. A flag given
    with its default value (``--dtype auto``) cannot be told from one not given, and changes nothing either."""
    import dataclasses

    from fastgate.serving.runtime import RuntimeConfig

    fields = {f.name: f for f in dataclasses.fields(RuntimeConfig)}
    given = []
    for name in LOCAL_SETTINGS:
        value = getattr(args, name, fields[name].default)
        if value != fields[name].default:
            flag = fields[name].metadata.get("flag", "--" + name.replace("_", "-"))  # as add_setting_args names it
            given.append(f"{flag} {value}")
    return given
