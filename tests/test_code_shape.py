"""The shape of the code (issue 68), parsed with `ast` (nothing is imported): no function
over MAX_LINES lines in the request path (entrypoints/, engine/, core/, worker/: a longer
one is a sign to split by responsibility), and no two classes of the package share a name
(a reader must not have to ask which StepCost is meant)."""
from __future__ import annotations

import ast
import collections
import os

PKG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "duetserve")
CHECKED = ("entrypoints", "engine", "core", "worker")
MAX_LINES = 60


def long_functions() -> list[str]:
    found = []
    for sub in CHECKED:
        for dirpath, _, files in os.walk(os.path.join(PKG_DIR, sub)):
            rel = os.path.relpath(dirpath, PKG_DIR)
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lines = node.end_lineno - node.lineno + 1
                        if lines > MAX_LINES:
                            found.append(f"{os.path.join(rel, name)}:{node.lineno} "
                                         f"{node.name} ({lines} lines)")
    return found


def test_no_long_functions_in_the_request_path() -> None:
    assert not long_functions(), "functions over 60 lines:\n  " + "\n  ".join(long_functions())


def test_no_two_classes_share_a_name() -> None:
    where = collections.defaultdict(list)
    for dirpath, _, files in os.walk(PKG_DIR):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(os.path.relpath(path, PKG_DIR))
    shared = {n: ps for n, ps in where.items() if len(ps) > 1}
    assert not shared, f"classes defined more than once: {shared}"
