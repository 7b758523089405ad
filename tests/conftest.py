"""Shared fixtures: tiny random-weight checkpoints saved as HF folders, the default model."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(2)
# Every engine the tests build (in process or a server subprocess) checks the scheduler's
# queues, block tables and block pool each time it goes idle.
os.environ.setdefault("DUET_CHECK_INTEGRITY", "1")

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
