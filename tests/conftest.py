"""Shared fixtures: tiny random-weight checkpoints saved as HF folders, the default model.

Nothing the tests run writes under the home directory: measurement caches go to a fresh
temporary directory per session (DUET_CACHE_DIR; engines and server subprocesses inherit
it), and so do the caches of the libraries the tests use. The native kernels build into
a folder of the checkout that git ignores (.pytest_cache/duet-native-ext), linked from
there, so they are built once and reused by later sessions."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(2)

_CACHE = tempfile.mkdtemp(prefix="duet-test-cache-")
atexit.register(shutil.rmtree, _CACHE, True)
_EXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    ".pytest_cache", "duet-native-ext")
os.makedirs(_EXT, exist_ok=True)
os.symlink(_EXT, os.path.join(_CACHE, "ext"))
os.environ["DUET_CACHE_DIR"] = _CACHE
for var, sub in (("XDG_CACHE_HOME", "xdg"), ("HF_HOME", "hf"), ("MPLCONFIGDIR", "mpl")):
    os.environ[var] = os.path.join(_CACHE, sub)

from tiny_models import TINY_VARIANTS, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {v: make_tiny_checkpoint(str(root / v), v) for v in TINY_VARIANTS}


@pytest.fixture(scope="session")
def default_model():
    from duetserve.loader import load_model
    return load_model(None)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from duetserve.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """transformers' model read from the default GGUF file, in float32, loaded once per
    session (its GGUF reader dequantizes in Python: ~30 s on a slow 2-core machine). The
    tests only run forward passes and generate() on it; none changes it."""
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(default_model_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()
