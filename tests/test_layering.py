"""The package's import graph is one-way: a lower layer never imports a higher one.

Every module under duetserve/ is parsed with `ast` (nothing is imported or executed) and
each import of duetserve.* (absolute, `from ... import`, relative, and
`importlib.import_module("<literal>")`) is checked against the layers below.

Layers, lowest first; a module may import its own layer and lower ones:

    0  config, errors, sampling_params, outputs, request, the package __init__
    1  core (never torch, anywhere, not even transitively), metrics (no torch at module
       level; measure.py times kernels with torch inside functions), models, loader,
       kv_transfer, structured (grammars with llguidance; never torch, like core)
    2  worker, spec_decode
    3  engine
    4  entrypoints, __main__, bench, sim, cluster (`duet cluster`: Ray actors running
       `duet serve`, the router in front)
    bench/{serve,datasets,bench_metrics,plot,token_workload,cpu_meter}.py import nothing
       from duetserve but each other: `duet bench serve` talks HTTP to any OpenAI server and
       must stay light.
    sim (the simulator) sits beside bench: it imports layer 0, core, metrics and those
       light bench modules, never torch, the engine, the worker or the models; and only
       entrypoints (and sim itself) may import sim.

Inside layer 1 (FORBIDDEN below): core does not import models/loader; models do not
import loader/core; metrics does not import models/loader/core. The loader may import
models (it builds them).

Rule for lazy imports: an import counts wherever it is (module level, class body,
function body). The few intentional exceptions, each an import inside a function that
keeps a light module light, are listed with a reason in ALLOWED_LAZY; an entry only
exempts an import that really is inside a function, and an entry that no longer matches
anything fails the test so the list cannot rot.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass

PKG = "duetserve"
PKG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PKG)

# Longest matching prefix wins. A module that matches nothing is an error: place it.
LAYERS: dict[str, int] = {
    "duetserve": 0,  # the package __init__ only (exact match, see layer_of)
    "duetserve.config": 0,
    "duetserve.errors": 0,
    "duetserve.sampling_params": 0,
    "duetserve.outputs": 0,
    "duetserve.request": 0,
    "duetserve.core": 1,
    "duetserve.metrics": 1,
    "duetserve.models": 1,
    "duetserve.loader": 1,
    "duetserve.kv_transfer": 1,
    "duetserve.structured": 1,
    "duetserve.worker": 2,
    "duetserve.spec_decode": 2,
    "duetserve.engine": 3,
    "duetserve.sim": 4,
    "duetserve.entrypoints": 4,
    "duetserve.__main__": 4,
    "duetserve.bench": 4,
    "duetserve.cluster": 4,
}

# Same-layer (or otherwise rank-legal) edges that are still not allowed.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "duetserve.core": ("duetserve.models", "duetserve.loader", "duetserve.worker"),
    "duetserve.models": ("duetserve.loader", "duetserve.core"),
    "duetserve.metrics": ("duetserve.models", "duetserve.loader", "duetserve.core",
                          "duetserve.worker", "duetserve.engine"),
    "duetserve.structured": ("duetserve.models", "duetserve.loader", "duetserve.core",
                             "duetserve.metrics"),
    # the runner gets its Speculator handed in by the engine; spec_decode builds on worker
    "duetserve.worker": ("duetserve.spec_decode",),
    "duetserve.sim": ("duetserve.models", "duetserve.loader", "duetserve.worker",
                      "duetserve.engine", "duetserve.kv_transfer", "duetserve.spec_decode",
                      "duetserve.entrypoints", "duetserve.bench.serve",
                      "duetserve.bench.throughput", "duetserve.bench.replay",
                      "duetserve.bench.serve_scenario"),
}

# Modules only the listed packages may import (besides themselves).
IMPORTED_ONLY_BY: dict[str, tuple[str, ...]] = {
    "duetserve.sim": ("duetserve.entrypoints",),
}

# HTTP-only benchmark modules: their whole duetserve import set must stay inside this set.
HTTP_ONLY = ("duetserve.bench.serve", "duetserve.bench.datasets",
             "duetserve.bench.bench_metrics", "duetserve.bench.plot",
             "duetserve.bench.token_workload", "duetserve.bench.cpu_meter")
HTTP_ONLY_MAY_IMPORT = HTTP_ONLY + ("duetserve.bench",)

# Not even inside functions, nor transitively.
NO_TORCH_ANYWHERE = ("duetserve.core", "duetserve.structured", "duetserve.sim")
NO_TORCH_AT_MODULE_LEVEL = ("duetserve.metrics",)

# (importing module, imported module): intentional lazy imports inside a function.
ALLOWED_LAZY: dict[tuple[str, str], str] = {
    ("duetserve", "duetserve.engine.llm"):
        "`from duetserve import LLM` via module __getattr__; keeps `import duetserve` torch-free",
    ("duetserve.metrics.roofline", "duetserve.loader"):
        "`duet roofline --model PATH` reads a checkpoint's config; only on that path",
}


@dataclass(frozen=True)
class Import:
    target: str       # resolved dotted name, e.g. duetserve.core.scheduler
    lineno: int
    in_function: bool
    type_only: bool   # under `if TYPE_CHECKING:`


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    if module == PKG:
        return LAYERS[PKG]
    best = None
    for prefix, rank in LAYERS.items():
        if prefix != PKG and _matches(module, prefix):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    return None if best is None else best[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def collect_imports(module: str, source: str, is_package: bool,
                    known_modules: set[str] | frozenset[str] = frozenset()) -> list[Import]:
    """All imports in `source` (the text of `module`), with relative names resolved.

    `from a.b import c` resolves to `a.b.c` when that is a known module, else to `a.b`."""
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    found: list[Import] = []

    def add(target: str, node: ast.AST, in_fn: bool, type_only: bool) -> None:
        found.append(Import(target, node.lineno, in_fn, type_only))

    def visit(node: ast.AST, in_fn: bool, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, in_fn, type_only)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package_parts[: len(package_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known_modules else base, node, in_fn, type_only)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value, node, in_fn, type_only)
        fn = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_fn, True)
            for child in node.orelse:
                visit(child, in_fn, type_only)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, in_fn or fn, type_only)

    visit(ast.parse(source), False, False)
    return found


def check_module(module: str, imports: list[Import], used_lazy: set | None = None) -> list[str]:
    """Violations of the layering rules by one module's imports (empty list: clean)."""
    errors: list[str] = []
    src_rank = layer_of(module)
    if src_rank is None:
        return [f"{module}: not assigned to a layer; add it to LAYERS in tests/test_layering.py"]
    for imp in imports:
        where = f"{module}:{imp.lineno} imports {imp.target}"
        if _matches(imp.target, "torch"):
            if any(_matches(module, p) for p in NO_TORCH_ANYWHERE) and not imp.type_only:
                errors.append(f"{where}: core, structured and sim must never import torch")
            elif (any(_matches(module, p) for p in NO_TORCH_AT_MODULE_LEVEL)
                  and not imp.in_function and not imp.type_only):
                errors.append(f"{where}: metrics may import torch only inside functions")
            continue
        if not _matches(imp.target, PKG):
            continue
        key = next((k for k in ALLOWED_LAZY if k[0] == module and _matches(imp.target, k[1])), None)
        if key is not None and imp.in_function:
            if used_lazy is not None:
                used_lazy.add(key)
            continue
        if any(_matches(module, m) for m in HTTP_ONLY):
            if imp.target not in HTTP_ONLY_MAY_IMPORT:
                errors.append(f"{where}: HTTP-only benchmark modules import only each other")
            continue
        dst_rank = layer_of(imp.target)
        if dst_rank is None:
            errors.append(f"{where}: target is not assigned to a layer")
            continue
        if dst_rank > src_rank:
            errors.append(f"{where}: layer {src_rank} must not import layer {dst_rank}")
            continue
        for src_prefix, banned in FORBIDDEN.items():
            if _matches(module, src_prefix):
                for b in banned:
                    if _matches(imp.target, b):
                        errors.append(f"{where}: {src_prefix} must not import {b}")
        for target, importers in IMPORTED_ONLY_BY.items():
            if (_matches(imp.target, target) and not _matches(module, target)
                    and not any(_matches(module, m) for m in importers)):
                errors.append(f"{where}: only {', '.join(importers)} may import {target}")
    return errors


def check_source(module: str, source: str, is_package: bool = False,
                 known_modules: set[str] | frozenset[str] = frozenset()) -> list[str]:
    return check_module(module, collect_imports(module, source, is_package, known_modules))


# ----------------------------------------------------------------------------- the package


def _package_modules() -> dict[str, tuple[str, bool]]:
    """module name -> (path, is_package) for every .py file under duetserve/."""
    mods: dict[str, tuple[str, bool]] = {}
    root = os.path.dirname(PKG_DIR)
    for dirpath, dirnames, filenames in os.walk(PKG_DIR):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), root)[:-3].split(os.sep)
            is_pkg = rel[-1] == "__init__"
            if is_pkg:
                rel = rel[:-1]
            mods[".".join(rel)] = (os.path.join(dirpath, fn), is_pkg)
    return mods


def _all_imports() -> dict[str, list[Import]]:
    mods = _package_modules()
    known = set(mods)
    out = {}
    for name, (path, is_pkg) in mods.items():
        with open(path, encoding="utf-8") as f:
            out[name] = collect_imports(name, f.read(), is_pkg, known)
    return out


def _cli_dispatch_targets() -> list[Import]:
    """`duet` subcommands are imported by name from the COMMANDS table in cli.py."""
    path = os.path.join(PKG_DIR, "entrypoints", "cli.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "COMMANDS":
            table = ast.literal_eval(node.value)
            return [Import(mod, node.lineno, True, False) for mod, _ in table.values()]
    return []


def test_package_layering() -> None:
    imports = _all_imports()
    imports["duetserve.entrypoints.cli"] = imports["duetserve.entrypoints.cli"] + _cli_dispatch_targets()
    used_lazy: set = set()
    errors = [e for mod in sorted(imports) for e in check_module(mod, imports[mod], used_lazy)]
    assert not errors, "layering violations:\n  " + "\n  ".join(errors)
    stale = set(ALLOWED_LAZY) - used_lazy
    assert not stale, f"ALLOWED_LAZY entries that match no lazy import (remove them): {stale}"


def test_torch_free_packages_are_torch_free_transitively() -> None:
    """core, structured and sim import nothing that pulls torch in at import time (package
    __init__ files of every imported module included): they must stay light and fast."""
    imports = _all_imports()

    def runtime_deps(mod: str) -> set[str]:
        deps = set()
        for imp in imports.get(mod, []):
            if imp.in_function or imp.type_only:
                continue
            parts = imp.target.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__, a/b/__init__
                deps.add(".".join(parts[:i]))
        return deps

    for start in (m for m in imports if any(_matches(m, p) for p in NO_TORCH_ANYWHERE)):
        seen, stack, parent = {start}, [start], {start: None}
        while stack:
            mod = stack.pop()
            for dep in runtime_deps(mod):
                if _matches(dep, "torch"):
                    chain, m = [], mod
                    while m is not None:
                        chain.append(m)
                        m = parent[m]
                    raise AssertionError(f"{start} pulls in torch via {' <- '.join(chain)}")
                if dep in imports and dep not in seen:
                    seen.add(dep)
                    parent[dep] = mod
                    stack.append(dep)


# ----------------------------------------------------------------------------- the checker


KNOWN = frozenset({"duetserve", "duetserve.engine", "duetserve.engine.llm", "duetserve.core",
                   "duetserve.core.x", "duetserve.core.hashing", "duetserve.config"})


def test_checker_catches_upward_import() -> None:
    errs = check_source("duetserve.core.x", "from duetserve.engine.llm import LLM\n")
    assert len(errs) == 1 and "layer 1 must not import layer 3" in errs[0]
    errs = check_source("duetserve.core.x", "import duetserve.engine.llm\n")
    assert len(errs) == 1
    # A lazy import counts too unless it is listed in ALLOWED_LAZY.
    errs = check_source("duetserve.core.x", "def f():\n    from duetserve.engine import llm\n",
                        known_modules=KNOWN)
    assert len(errs) == 1 and "duetserve.engine.llm" in errs[0]
    # importlib.import_module with a literal name is an import.
    errs = check_source("duetserve.core.x",
                        "import importlib\nimportlib.import_module('duetserve.engine.llm')\n")
    assert len(errs) == 1


def test_checker_resolves_relative_imports() -> None:
    errs = check_source("duetserve.core.x", "from ..engine import llm\n", known_modules=KNOWN)
    assert len(errs) == 1 and "imports duetserve.engine.llm" in errs[0]
    errs = check_source("duetserve.core", "from ..engine.llm import LLM\n", is_package=True)
    assert len(errs) == 1 and "imports duetserve.engine.llm" in errs[0]
    assert check_source("duetserve.core.x", "from . import hashing\nfrom ..config import A\n",
                        known_modules=KNOWN) == []


def test_checker_torch_and_intra_layer_rules() -> None:
    assert check_source("duetserve.core.x", "def f():\n    import torch\n")
    assert check_source("duetserve.core.x", "from torch import nn\n")
    assert check_source("duetserve.metrics.x", "import torch\n")
    assert check_source("duetserve.metrics.x", "class A:\n    import torch\n")
    assert check_source("duetserve.metrics.x", "def f():\n    import torch\n") == []
    assert check_source("duetserve.models.x", "from duetserve.loader import load_model\n")
    assert check_source("duetserve.core.x", "from duetserve.models.decoder import Llama\n")
    assert check_source("duetserve.loader.x", "from duetserve.models.registry import model_class\n") == []
    assert check_source("duetserve.metrics.x", "from duetserve.core.scheduler import S\n")
    assert check_source("duetserve.bench.serve", "from duetserve.config import ModelConfig\n")
    assert check_source("duetserve.bench.serve", "from duetserve.bench.datasets import D\n") == []
    assert check_source("duetserve.bench.throughput", "from duetserve.engine.llm import LLM\n") == []
    assert check_source("duetserve.newpkg.x", "") != []  # unplaced module
    assert check_source("duetserve.sim.x", "from duetserve.core.scheduler import S\n") == []
    assert check_source("duetserve.sim.x", "from duetserve.bench.datasets import D\n") == []
    assert check_source("duetserve.sim.x", "from duetserve.engine.llm import LLM\n")
    assert check_source("duetserve.sim.x", "def f():\n    import torch\n")
    assert check_source("duetserve.bench.replay", "from duetserve.sim.run import simulate\n")
    assert check_source("duetserve.engine.x", "from duetserve.sim import run\n")
    assert check_source("duetserve.entrypoints.x", "from duetserve.sim.run import simulate\n") == []


def test_allowed_lazy_only_exempts_function_bodies() -> None:
    src_lazy = "def f():\n    from duetserve.loader import load_model_config\n"
    src_top = "from duetserve.loader import load_model_config\n"
    assert check_source("duetserve.metrics.roofline", src_lazy) == []
    assert check_source("duetserve.metrics.roofline", src_top) != []
    assert check_source("duetserve", "def __getattr__(n):\n    from duetserve.engine.llm import LLM\n") == []
    assert check_source("duetserve", "from duetserve.engine.llm import LLM\n") != []
