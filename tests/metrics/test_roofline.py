"""Roofline analysis and `duet roofline` against public reference figures."""
from __future__ import annotations

import json
import os

import pytest

from duetserve.config import ConfigError
from duetserve.entrypoints.cli import main as cli_main
from duetserve.metrics import hardware
from duetserve.metrics.cost_model import decode_step, kv_bytes_held, param_count, step_work
from duetserve.metrics.known_models import GEMMA_3_270M, LLAMA_2_7B, LLAMA_3_8B, SMOLLM2_135M
from duetserve.metrics.roofline import analyse


def test_ridge_points() -> None:
    assert hardware.get_hardware("h100-sxm").ridge_point() == pytest.approx(989e12 / 3.35e12)
    assert round(hardware.get_hardware("H100-SXM").ridge_point()) == 295
    assert hardware.get_hardware("a100").ridge_point() == pytest.approx(156.0)
    # the datasheet A100 80GB SXM figure (2.039 TB/s) gives 153
    assert hardware.get_hardware("a100-80gb").ridge_point() == pytest.approx(312 / 2.039)
    with pytest.raises(ConfigError, match="known: h100-sxm"):
        hardware.get_hardware("tpu")


def test_llama3_8b_h100_decode_bound() -> None:
    r = analyse(LLAMA_3_8B, "h100-sxm", batch=1, prompt_len=512, context_len=512, dtype="bf16")
    assert r["ridge_point"] == pytest.approx(295.2, abs=0.1)
    # rule of thumb: 3.35e12 / (8.03e9 params x 2 bytes = 16.06e9) = 208.6 tok/s
    assert r["model"]["weight_bytes_total"] == 16_060_522_496
    assert r["decode_tok_s_batch1_model_size"] == pytest.approx(3.35e12 / 16_060_522_496)
    assert round(r["decode_tok_s_batch1_model_size"]) == 209
    # cost model: the embedding is gathered (-1.05 GB) but 512 tokens of KV are read.
    dec = r["decode_batch1"]
    assert dec["bound"] == "memory" and r["prefill"]["bound"] == "compute"
    assert r["decode_tok_s_batch1"] == pytest.approx(3.35e12 / dec["bytes"])
    assert 209 < r["decode_tok_s_batch1"] < 230
    assert r["prefill_time_s"] == pytest.approx(r["prefill"]["flops"] / 989e12)
    assert r["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2


def test_ridge_crossing_batch_is_smallest() -> None:
    r = analyse(LLAMA_3_8B, "h100-sxm", batch=8, prompt_len=128, context_len=128, dtype="bf16")
    b = r["ridge_crossing_batch_context0"]
    ridge = r["ridge_point"]
    kw = {"weight_dtype": "bf16", "kv_dtype": "bf16"}
    assert step_work(LLAMA_3_8B, decode_step(b, 0), **kw).ai >= ridge
    assert step_work(LLAMA_3_8B, decode_step(b - 1, 0), **kw).ai < ridge
    assert 280 < b < 310       # about the ridge point, as the rule "AI ~ B" says
    # 128 tokens of context per request push the crossing out (KV reads grow with B) ...
    assert r["ridge_crossing_batch"] > b
    # ... and 2,048 tokens cap decode AI below the ridge: it never crosses.
    r2 = analyse(LLAMA_3_8B, "h100-sxm", batch=8, prompt_len=128, context_len=2048)
    assert r2["ridge_crossing_batch"] is None and r2["decode_ai_limit"] < ridge
    assert r["decode_tok_s_batch"] > 7 * r["decode_tok_s_batch1"]


def test_kv_reference_and_json_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["roofline", "--model", "llama-2-7b", "--hardware", "h100-sxm",
                   "--dtype", "f16", "--context-len", "4096", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kv_bytes_per_request"] == 2_147_483_648
    assert r["model"]["name"] == "llama-2-7b"


def test_cli_text_and_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["roofline", "--model", "llama-3-8b", "--hardware", "h100-sxm",
                     "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "ridge     295.2 FLOP/byte" in out and "208.6 tok/s" in out
    assert cli_main(["roofline", "--list"]) == 0
    out = capsys.readouterr().out
    assert "tinyllama-1.1b" in out and "a100-80gb" in out and "l40s" in out
    assert cli_main(["roofline", "--model", "gpt-9"]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err


def test_quantised_weights_use_hardware_compute(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    r = analyse(SMOLLM2_135M, "cpu", 1, 64, 64, "q8_0")
    assert r["model"]["compute_dtype"] == "fp32" and r["model"]["kv_dtype"] == "f16"
    assert r["hardware"]["measured"] is False
    assert r["ridge_point"] == pytest.approx(310e9 / 30e9)


def test_measured_cache_roundtrip(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    assert hardware.get_hardware("local") == hardware.CPU_FALLBACK
    path = hardware.save_measured(200e9, 25e9, {"threads": 2})
    assert path == tmp_path / "hardware.json"
    hw = hardware.get_hardware("cpu")
    assert hw.measured and hw.peak("fp32") == 200e9 and hw.ridge_point() == pytest.approx(8.0)
    # a cache without other peaks keeps the example's; measured ones replace them
    assert hw.peak("bf16") == hardware.CPU_FALLBACK.peak("bf16")
    hardware.save_measured(200e9, 25e9, {"threads": 2}, {"bf16": 800e9, "int8": 1.6e12})
    hw = hardware.get_hardware("cpu")
    assert (hw.peak("fp32"), hw.peak("bf16"), hw.peak("int8")) == (200e9, 800e9, 1.6e12)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        analyse(LLAMA_2_7B, "h100-sxm", 0, 1, 1, "f16")
    with pytest.raises(ConfigError, match="has no fp8"):
        analyse(LLAMA_2_7B, "a100", 1, 1, 1, "f16", compute_dtype="fp8")


def test_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "roof.png"
    assert cli_main(["roofline", "--model", "llama-3-8b", "--hardware", "a100", "--batch", "32",
                     "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000


def test_known_family_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["roofline", "--list"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b" in out and "top 8 of 128 experts (3.35 B active)" in out
    assert "gemma-3-270m" in out and "15 sliding-window layers (512)" in out
    assert cli_main(["roofline", "--model", "gemma-3-270m", "--context-len", "8192",
                     "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    full = r["kv_bytes_per_token"] * 8192
    assert r["kv_bytes_per_request"] / full == pytest.approx(1 / 6 + 5 / 6 * 512 / 8192)
    assert (r["model"]["sliding_layers"], r["model"]["sliding_window"]) == (15, 512)


def _moe_roofline(path: str, capsys) -> dict:
    assert cli_main(["roofline", "--model", path, "--context-len", "64", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_moe_checkpoint_folder_and_gguf(tmp_path, capsys) -> None:
    """A tiny random Qwen3-MoE (tests/tiny_families.py: d 64, 3 layers, 4 q / 2 kv heads
    of 16, vocab 300, top 2 of 8 experts of 32, layer 1 a dense MLP of 160), as a HF folder
    and as a GGUF (llama.cpp's format: experts in every layer)."""
    from gguf_writer import write_gguf
    from tiny_families import make_family_checkpoint

    from duetserve.loader import load_model_config
    folder = make_family_checkpoint(str(tmp_path / "moe"), "qwen3_moe")
    r = _moe_roofline(folder, capsys)
    # attention 4096 + 2048 + 2048 + 4096 a layer; norms 2 x 64 + QK-norm 2 x 16; layer
    # 1's MLP 3 x 64 x 160; layers 0 and 2: router 64 x 8, experts of 3 x 64 x 32 = 6144
    layers = 3 * 12288 + 3 * 160 + 30720 + 2 * (512 + 8 * 6144)
    assert r["model"]["params"] == layers + 2 * 300 * 64 + 64 == 205856
    assert r["model"]["active_params"] == 205856 - 2 * 6 * 6144 == 132128
    assert r["model"]["weight_source"] == "file"      # the safetensors shard's bytes
    # the GGUF: experts in all 3 layers, float32 tensors: 4 bytes a parameter exactly
    gguf_dir = make_family_checkpoint(str(tmp_path / "moe_all"), "qwen3_moe", mlp_only_layers=[])
    path = write_gguf(gguf_dir, str(tmp_path / "moe.gguf"))
    g = _moe_roofline(path, capsys)
    cfg = load_model_config(path)
    assert cfg.moe_layer_ids == (0, 1, 2)
    total = 3 * (12288 + 160 + 512 + 8 * 6144) + 2 * 300 * 64 + 64
    assert g["model"]["params"] == total and g["model"]["weight_bytes_total"] == 4 * total
    assert g["model"]["bits_per_weight"] == 32.0
    # float32 weights: a float32 KV cache (the roofline takes a float weight dtype for it)
    dec = step_work(cfg, decode_step(1, 64), weight_bytes=4 * total, kv_dtype="f32")
    assert g["decode_batch1"]["bytes"] == dec.bytes
    # one row reads 2 of the 8 experts of each layer
    assert dict(dec.byte_terms)["weights.experts"] == 3 * 2 * 6144 * 4


GEMMA_FILE = os.path.join(os.environ.get("DUET_MODELS",
                                         os.path.expanduser("~/.cache/duetserve-models")),
                          "gemma-3-270m-q4_k_m.gguf")


@pytest.mark.skipif(not os.path.isfile(GEMMA_FILE),
                    reason=f"{GEMMA_FILE} absent (shared/models/fetch.sh gemma3-270m)")
def test_real_gemma3_file(capsys) -> None:
    """The real Gemma 3 270M GGUF: the shape of the built-in profile, its sliding layers,
    and the bytes of its (mixed Q4_K_M) tensors."""
    from duetserve.loader import checkpoint_shape
    cfg, nbytes = checkpoint_shape(GEMMA_FILE)
    assert param_count(cfg) == param_count(GEMMA_3_270M)
    assert cfg.layer_types == GEMMA_3_270M.layer_types and cfg.sliding_window == 512
    assert 0.9 * os.path.getsize(GEMMA_FILE) < nbytes < os.path.getsize(GEMMA_FILE)
    assert cli_main(["roofline", "--model", GEMMA_FILE, "--context-len", "8192",
                     "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"]["weight_bytes_total"] == nbytes and r["model"]["sliding_layers"] == 15
    assert r["kv_bytes_per_request"] == kv_bytes_held(cfg, 8192, "f16")
