from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`make test`) each worker gets its share of the cores, set before torch is imported: two workers
# with two OpenMP threads each on two cores spin against each other (the suite ran 2.9x slower).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU the Triton kernels run in Triton's CPU interpreter; it must be chosen before any kernel is defined.
if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The slowest modules first (seconds of a run on 2 cores, 2026-11-29): `make test` runs xdist's loadscope without its
# reorder by test count, which ran the Ray module (57 s, five tests) last, alone on one worker while the other idled.
_SLOW_FIRST = ("test_ray_serve.py", "test_static_step.py", "test_e2e.py", "test_server.py", "test_quant.py",
               "test_scheduler.py", "test_read_gate.py", "test_imports.py", "test_eval.py", "test_cli.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its own order


SMALL_CORPUS = [
    {"id": "p1", "title": "Paris", "text": "Paris is the capital and largest city of France, on the Seine."},
    {"id": "p2", "title": "Berlin", "text": "Berlin is the capital of Germany and its largest city."},
    {"id": "p3", "title": "Ouagadougou", "text": "Ouagadougou is the capital of Burkina Faso in West Africa."},
    {"id": "p4", "title": "Bishkek", "text": "Bishkek is the capital and largest city of Kyrgyzstan."},
    {"id": "p5", "title": "Hamlet", "text": "Hamlet is a tragedy written by William Shakespeare around 1600."},
    {"id": "p6", "title": "Eiffel Tower", "text": "The Eiffel Tower in Paris was completed in 1889 by Gustave Eiffel."},
    {"id": "p7", "title": "Jupiter", "text": "Jupiter is the fifth planet from the Sun and the largest planet."},
]


@pytest.fixture(scope="session")
def tiny():
    from fastgate.testing import tiny_model

    return tiny_model()


@pytest.fixture(scope="session")
def tiny_engine(tiny):
    from fastgate.engine.local import Engine

    return Engine(tiny)


@pytest.fixture(scope="session")
def small_corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SMALL_CORPUS))
    return path


@pytest.fixture(scope="session")
def small_index(tmp_path_factory, small_corpus_file):
    """BM25 + dense indexes of the small corpus (dense uses the packaged MiniLM)."""
    from fastgate.retrieval import build_indexes

    root = tmp_path_factory.mktemp("index")
    build_indexes(small_corpus_file, root, progress=False)
    return root
