"""One engine contract: the local and the remote engine implement :class:`fastgate.engine.protocol.LLMEngine`, their
capabilities are declared attributes, and nothing in fastgate probes an engine with ``getattr``."""

from __future__ import annotations

import re
from pathlib import Path

from fastgate.engine.protocol import ConcurrentEngine, LLMEngine
from fastgate.engine.remote import RemoteConfig, RemoteEngine

ROOT = Path(__file__).resolve().parent.parent


def test_the_local_engine_implements_the_contract(tiny_engine):
    assert isinstance(tiny_engine, LLMEngine)
    assert tiny_engine.remote is False and tiny_engine.black_box is False
    assert not isinstance(tiny_engine, ConcurrentEngine)  # no generate_each: its generations join the decode loop


def test_the_remote_engine_implements_the_contract_and_declares_what_it_cannot_do():
    engine = RemoteEngine(RemoteConfig("http://127.0.0.1:9/v1", "stub"))  # never contacted
    try:
        assert isinstance(engine, LLMEngine) and isinstance(engine, ConcurrentEngine)
        assert engine.remote is True and engine.black_box is True
    finally:
        engine.close()


def test_no_module_probes_an_engine_for_a_capability():
    probes = []
    for path in sorted((ROOT / "fastgate").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""getattr\([\w.]*engine[\w.]*,\s*["'](remote|black_box)["']""", line):
                probes.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not probes, "declare the capability on the engine (fastgate.engine.protocol) instead:\n" + "\n".join(probes)
