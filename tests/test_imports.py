"""Import structure: every module imports on its own, and no import cycle runs anywhere in fastgate (the engine's
loops once imported its types while it imported them; the server and its OpenAI routes, the CLI and calibration, the
methods table and the read gate each imported the other).

The graph counts every ``import`` of a fastgate module, at module level or inside a function (a lazy import still
ties the two modules together), but not those under ``if TYPE_CHECKING:`` (annotations only, never executed).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fastgate": ROOT / "fastgate", "fastgate.kernels": ROOT / "kernels"}  # setup.py's package_dir

# Modules the graph must hold (a rename that drops one from the graph should fail loudly, not pass vacuously).
CORE = {"fastgate.engine.local", "fastgate.engine.model_runner", "fastgate.engine.decode", "fastgate.engine.packed",
        "fastgate.engine.generation", "fastgate.scheduler", "fastgate.engine.kv_cache", "fastgate.assets.models",
        "fastgate.gates.base", "fastgate.gates.eigen",
        "fastgate.gates.prober", "fastgate.gates.uncertainty", "fastgate.gates.words", "fastgate.gates.read",
        "fastgate.scheduler.driver", "fastgate.scheduler.batching", "fastgate.scheduler.admission",
        "fastgate.scheduler.config", "fastgate.scheduler.task"}



def modules() -> dict[str, Path]:
    """Every fastgate module name -> its file."""
    out = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module -> the fastgate modules it imports (a ``from package import name`` counts the submodule ``name`` when
    there is one, else the package)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in mods:
                        deps.add(sub)
                    elif base in mods:
                        deps.add(base)
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):  # importlib.import_module("fastgate.x"): an import too
                target = node.args[0].value
                if target in mods or target == EXTENSION:
                    deps.add(target)
        deps.discard(name)
        graph[name] = deps
    graph[EXTENSION] = set()  # compiled: it imports nothing of fastgate
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [{"a", "b", "c"}]


def test_no_import_cycle_anywhere_in_fastgate():
    """No cycle at all, lazy imports included: each module imports only modules below it."""
    graph = import_graph()
    assert CORE <= set(graph), f"modules renamed? {sorted(CORE - set(graph))}"
    found = sorted(sorted(c) for c in cycles(graph))
    assert not found, f"import cycles: {found}"


def test_no_import_cycle_in_the_http_package():
    """Any cycle through a module of fastgate.entrypoints.http fails, known or not (the package's modules import
    downwards:
    common, protocol, errors, ..., routes, app); a module of the package importing the package itself counts (its
    ``__init__`` imports the app)."""
    graph = import_graph()
    http = {m for m in graph if m == "fastgate.entrypoints.http" or m.startswith("fastgate.entrypoints.http.")}
    assert {"fastgate.entrypoints.http", "fastgate.entrypoints.http.app", "fastgate.entrypoints.http.protocol",
            "fastgate.entrypoints.http.errors"} <= http
    found = [sorted(c) for c in cycles(graph) if c & http]
    assert not found, f"import cycles through fastgate.entrypoints.http: {found}"
    inward = sorted(m for m in http - {"fastgate.entrypoints.http"} if "fastgate.entrypoints.http" in graph[m])
    assert not inward, f"modules of fastgate.entrypoints.http importing the package itself: {inward}"


def test_the_loops_and_gates_do_not_import_the_engine():
    graph = import_graph()
    for name in ("fastgate.engine.model_runner", "fastgate.engine.decode", "fastgate.engine.packed",
                 "fastgate.engine.generation"):
        assert "fastgate.engine.local" not in graph[name], name
    for name in [m for m in graph if m.startswith("fastgate.gates.")]:
        assert "fastgate.engine.local" not in graph[name], f"{name} imports the engine (the gates need only the types)"


def test_every_module_imports_first():
    """Each module imported first, in a fresh set of fastgate modules (one interpreter per half of the list, the two
    side by side: torch loads once in each); ``fastgate.__main__`` runs the CLI, so it is left out."""
    names = sorted(m for m in modules() if not m.endswith(".__main__"))
    code = ("import importlib, sys\n"
            "names = sys.argv[1:]\n"
            "failed = []\n"
            "for name in names:\n"
            "    for m in [m for m in sys.modules if m == 'fastgate' or m.startswith('fastgate.')]:\n"
            "        if m != 'fastgate._C':\n"
            "            del sys.modules[m]\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception as exc:\n"
            "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
            "print('\\n'.join(failed))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, *names[i::2]], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == "", out


def test_the_engine_module_still_exports_the_result_types():
    from fastgate.engine import generation
    from fastgate.engine import local as engine

    assert engine.Generation is generation.Generation
    assert engine.GenerationBatch is generation.GenerationBatch
    assert engine.FinishReason is generation.FinishReason


# The layers of docs/ARCHITECTURE.md, from the bottom up: a module may import its own layer and those below, never one
# above (lazy imports included). Within a layer, a longer prefix wins (fastgate.version is base, fastgate the facade).
EXTENSION = "fastgate._C"  # the compiled C++ library (csrc/): it imports nothing of fastgate

LAYERS = [
    ("base", ("fastgate.errors", "fastgate.settings", "fastgate.config", "fastgate.version", EXTENSION)),
    ("models and data", ("fastgate.assets",)),
    ("prompts", ("fastgate.prompts",)),
    ("ops and kernels", ("fastgate.ops", "fastgate.kernels")),
    ("retrieval", ("fastgate.retrieval",)),
    ("engine", ("fastgate.engine",)),
    ("gates", ("fastgate.gates",)),
    ("programs", ("fastgate.programs",)),
    ("scheduler", ("fastgate.scheduler",)),
    ("methods", ("fastgate.methods",)),
    ("serving", ("fastgate.serving",)),
    ("evaluation", ("fastgate.eval",)),
    ("training", ("fastgate.train",)),
    ("entry points", ("fastgate.entrypoints", "fastgate.__main__")),
    ("facade", ("fastgate", "fastgate.testing")),
]


def layer_of(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} is in no layer of docs/ARCHITECTURE.md (add it to LAYERS and the page)"
    return best[0]


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph()
    up = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
          for m, deps in sorted(graph.items()) for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert not up, "imports against the layer order:\n" + "\n".join(up)


def test_the_layer_test_can_fail():
    assert layer_of("fastgate.engine.packed") < layer_of("fastgate.scheduler.driver")
    # a string import is an import: the assets asking the extension are seen (and allowed: it is at the base)
    assert EXTENSION in import_graph()["fastgate.assets.quant"] and layer_of(EXTENSION) == 0
    assert layer_of("fastgate.version") < layer_of("fastgate.entrypoints.http.common") < layer_of("fastgate")


def test_the_architecture_page_names_every_layer_folder():
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for _, prefixes in LAYERS[1:-1]:
        for p in prefixes:
            folder = p.removeprefix("fastgate.").replace(".", "/")
            path = "kernels/" if p == "fastgate.kernels" else f"fastgate/{folder}"
            assert path in page, f"docs/ARCHITECTURE.md does not name {path}"


def test_at_most_twelve_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / "fastgate").glob("*.py"))
    assert len(top) <= 12, top


def test_the_version_is_the_projects():
    import re

    from fastgate.version import __version__

    assert re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1) == __version__


def test_setup_lists_every_package():
    """A package missing from setup.py's list is left out of a wheel (``pip install .``) while an editable install
    still finds it: a new package must be listed."""
    import re

    listed = set(re.findall(r'"(fastgate(?:\.[a-z_]+)*)"', (ROOT / "setup.py").read_text()))
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert packages <= listed, f"packages missing from setup.py: {sorted(packages - listed)}"


# what the line a doc links to (``path#Ln``) must hold: the links of docs/ARCHITECTURE.md's newcomer routes
LINKED_LINES = {"fastgate/methods/dtr.py": "Decide(", "fastgate/engine/packed.py": "def step(",
                "fastgate/engine/kv_cache.py": "class KVCacheManager", "fastgate/engine/protocol.py": "class LLMEngine"}


def test_line_links_in_the_docs_point_at_their_lines():
    import re

    found = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, line in re.findall(r"\]\(((?:\.\./)?fastgate/[\w/]+\.py)#L(\d+)\)", page.read_text()):
            path = (page.parent / target).resolve().relative_to(ROOT).as_posix()
            lines = (ROOT / path).read_text().splitlines()
            assert int(line) <= len(lines), f"{page.name}: {path}#L{line} is past the end of the file"
            want = LINKED_LINES.get(path)
            assert want is not None, f"{page.name} links {path}#L{line}: say in LINKED_LINES what that line holds"
            assert want in lines[int(line) - 1], f"{page.name}: {path}#L{line} no longer holds {want!r}"
            found += 1
    assert found >= 4  # the newcomer's routes of docs/ARCHITECTURE.md


def test_the_default_model_is_named_in_the_pins_and_the_model_table_only():
    named = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "fastgate").rglob("*.py"))
             if "smollm2-135m" in p.read_text()]
    assert set(named) <= {"fastgate/assets/pins.py", "fastgate/assets/models.py"}, named
