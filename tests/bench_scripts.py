"""Import a benchmark script (benchmarks/NAME.py) in a test, as its own directory's script.

The scripts add benchmarks/ to sys.path to import each other; sys.path is restored
afterwards, since benchmarks/spec_decode.py would otherwise shadow tests/spec_decode in a
full run."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType


def import_benchmark(name: str) -> ModuleType:
    saved = list(sys.path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved
