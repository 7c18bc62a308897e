"""Every `fastgate ...` command in the README's and docs/'s code blocks parses with today's CLI, and the methods and
parameters it names pass the checks a run makes before it loads anything.

docs/RESULTS.md is left out: it records the commands each result was made with, at the time (flags since renamed
stay there as they ran); the docs a user follows are checked."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "RESULTS.md")]
_FENCE = re.compile(r"^\s*(```|~~~)")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]+$")  # DIR, FILE, URL: a value the reader supplies (`checkpoint=DIR`)


def _blocks(text: str) -> list[str]:
    """The fenced code blocks of a page (any language), each as its text."""
    blocks, current = [], None
    for line in text.splitlines():
        if _FENCE.match(line):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _commands(page: Path) -> list[tuple[str, list[str]]]:
    """``(line, argv)`` of every fastgate command in the page's code blocks: continuation lines joined, shell
    variables a block sets expanded, each command of a ``&&`` / ``|`` / ``;`` chain on its own; commands with
    placeholders (``<...>``, ``--flag ...`` but not a question written ``"..."``, an unset ``$VAR``, a synopsis's
    ``[--flag]``, an upper-case value such as ``DIR``) are left out."""
    found = []
    for block in _blocks(page.read_text()):
        env: dict[str, str] = {}
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip().removeprefix("$ ")
            for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
                try:
                    toks = shlex.split(part, comments=True)
                except ValueError:  # not shell (output, JSON)
                    continue
                if len(toks) == 1 and (m := _ASSIGN.match(toks[0])):
                    env[m.group(1)] = m.group(2)
                    continue
                while toks and _ASSIGN.match(toks[0]):  # FASTGATE_HOME=... fastgate ...
                    toks.pop(0)
                if not toks:
                    continue
                if Path(toks[0]).name == "fastgate":
                    argv = toks[1:]
                elif len(toks) > 2 and toks[1:3] == ["-m", "fastgate"]:
                    argv = toks[3:]
                else:
                    continue
                expanded = []
                for tok in argv:
                    if tok.startswith("$") and tok[1:].strip("{}") in env:
                        expanded.extend(shlex.split(env[tok[1:].strip("{}")]))
                    else:
                        expanded.append(tok)
                # a question written as "..." is a question; any other "..." stands for what the reader fills in
                if any("<" in t or ("..." in t and t != "...") or "$" in t or t.startswith("[")
                       or _PLACEHOLDER.match(t.rpartition("=")[2]) for t in expanded):
                    continue
                found.append((line, expanded))
    return found


CASES = [(page.name, line, argv) for page in PAGES for line, argv in _commands(page)]


def test_the_docs_hold_commands():
    assert len(CASES) >= 30, len(CASES)  # the extraction found them (a fence or prompt change lost them all)


@pytest.mark.parametrize(("page", "line", "argv"), CASES, ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(CASES)])
def test_a_documented_command_parses_and_names_real_methods(page, line, argv):
    from fastgate.entrypoints.cli import build_parser
    from fastgate.serving.runtime import check_request
    from fastgate.settings import parse_params

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code:  # --help and --version exit 0
            pytest.fail(f"{page}: `{line}` does not parse: {err.getvalue().strip()}")
        return
    methods = getattr(args, "method", None)
    if not methods or args.command not in ("ask", "eval", "serve", "calibrate"):
        return
    remote = "openai" if getattr(args, "engine", "local") == "openai" else None
    params = parse_params(getattr(args, "param", None) or [])
    model = getattr(args, "model", None)
    for name in (m.strip() for m in methods.split(",") if m.strip()):
        check_request(name, params, getattr(args, "retriever", None), model, remote=remote)
