"""Bad checkpoints give a one-line error naming the problem, never a traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest

from duetserve.errors import CheckpointError
from duetserve.loader import load_model, load_model_config


def _tiny_gguf(path: str, arch: str = "llama") -> str:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_not_found(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"))


def test_not_a_file(tmp_path):
    with pytest.raises(CheckpointError, match="folder without config.json"):
        load_model(str(tmp_path))


def test_not_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 definitely a zip file")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_model(str(p))


def test_truncated(tmp_path, default_model_path):
    p = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(5_000_000))
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(str(p))


def test_unsupported_architecture(tmp_path):
    p = _tiny_gguf(str(tmp_path / "gpt.gguf"), arch="gptneox")
    with pytest.raises(CheckpointError, match="unsupported architecture 'gptneox'.*llama"):
        load_model_config(p)


def test_unsupported_hf_architecture(tmp_path, tiny_checkpoints):
    d = tmp_path / "bert"
    shutil.copytree(tiny_checkpoints["llama-gqa-tied"], d)
    cfg = (d / "config.json").read_text().replace('"llama"', '"bert"')
    (d / "config.json").write_text(cfg)
    with pytest.raises(CheckpointError, match="unsupported architecture.*supported model types: .*llama"):
        load_model_config(str(d))


def test_missing_weight_is_named(tmp_path, tiny_checkpoints):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "missing"
    shutil.copytree(tiny_checkpoints["llama-gqa-untied"], d)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing weights for: layers.1.mlp.gate_up_proj"):
        load_model(str(d))


@pytest.mark.parametrize("kind", ["missing", "not_gguf", "arch"])
def test_cli_prints_one_line(tmp_path, kind):
    if kind == "missing":
        path = str(tmp_path / "nope.gguf")
    elif kind == "not_gguf":
        path = str(tmp_path / "x.gguf")
        open(path, "wb").write(b"hello")
    else:
        path = _tiny_gguf(str(tmp_path / "a.gguf"), arch="falcon")
    r = subprocess.run([sys.executable, "-m", "duetserve", "generate", "--model", path,
                        "--prompt", "hi"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("duet: error:"), r.stderr
