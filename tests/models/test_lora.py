"""LoRA adapters (PEFT files made with peft) on the decoder against the same adapter merged
into the weights and run by transformers (float32), and the adapter checks' errors."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import make_adapter, merged_reference
from model_helpers import rel_err
from tiny_models import make_tiny_checkpoint
from duetserve.errors import LoRAError
from duetserve.loader import load_model
from duetserve.models.lora import LoRABatch, load_adapter
from duetserve.worker.batch import SeqWork, build_step_batch, chunk_rows
from duetserve.worker.kv_cache import allocate_kv_cache

PROMPTS = [[5, 17, 99, 3, 250, 42, 42, 7, 128, 64, 1], [200, 33, 12, 90, 91],
           [92, 150, 11, 8, 8, 9, 70, 71, 72], [3, 4], [260, 14, 15, 16, 17, 18, 19]]
# (rank, alpha, rsLoRA, targets)
ADAPTERS = [(4, 8, False, None), (8, 16, True, None), (2, 4, False, None),
            (6, 3, False, ["q_proj", "v_proj", "up_proj"])]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(str(root / "base"), "llama-gqa-untied")
    adapters = [make_adapter(base, str(root / f"a{i}"), seed=i + 1, r=r, alpha=alpha,
                             use_rslora=rs, targets=t)
                for i, (r, alpha, rs, t) in enumerate(ADAPTERS)]
    return base, adapters, load_model(base)


def _last_logits(loaded, prompts: list[list[int]], slots: list[int],
                 adapters: list) -> list[torch.Tensor]:
    """One prefill step of every prompt (prompt i under adapter slot slots[i], -1: none);
    the last position's logits of each."""
    bs = 4
    kv = allocate_kv_cache(loaded.config, 64, bs, torch.float32, "cpu")
    work, next_block = [], 0
    for i, (p, s) in enumerate(zip(prompts, slots)):
        n = (len(p) + bs - 1) // bs
        work.append(SeqWork(str(i), p, 0, list(range(next_block, next_block + n)), True,
                            lora_slot=s))
        next_block += n
    batch = build_step_batch(work, bs)
    with torch.inference_mode():
        hidden = loaded.model(batch.input_ids, batch.positions, kv, batch.meta,
                              LoRABatch.from_rows(batch.lora_slots or [], adapters))
        logits = loaded.model.compute_logits(hidden[batch.logits_indices])
    by_id = dict(zip(batch.logits_req_ids, logits))
    return [by_id[str(i)] for i in range(len(prompts))]


_MERGED: dict = {}


def _reference(base: str, adapter: str | None, prompt: list[int]) -> torch.Tensor:
    """The merged reference's last logits (each merged model built once)."""
    if (base, adapter) not in _MERGED:
        _MERGED[base, adapter] = merged_reference(base, adapter)
    with torch.no_grad():
        return _MERGED[base, adapter](torch.tensor([prompt])).logits[0, -1]


def test_each_adapter_matches_merged_reference(lora_setup):
    base, paths, loaded = lora_setup
    cfg = loaded.config
    adapters = [load_adapter(p, cfg, max_rank=16) for p in paths]
    base_ref = _reference(base, None, PROMPTS[0])
    for i, path in enumerate(paths):
        ref = _reference(base, path, PROMPTS[0])
        assert rel_err(ref, base_ref) > 0.05           # the adapter changes the model
        ours = _last_logits(loaded, PROMPTS[:1], [i], adapters)[0]
        assert rel_err(ours, ref) < 1e-4, (i, rel_err(ours, ref))


def test_mixed_adapters_in_one_step(lora_setup):
    """Five prompts in one step: four adapters and the base, each row its own."""
    base, paths, loaded = lora_setup
    adapters = [load_adapter(p, loaded.config, max_rank=16) for p in paths]
    slots = [2, -1, 0, 3, 1]
    ours = _last_logits(loaded, PROMPTS, slots, adapters)
    for prompt, slot, got in zip(PROMPTS, slots, ours):
        ref = _reference(base, None if slot < 0 else paths[slot], prompt)
        assert rel_err(got, ref) < 1e-4, (slot, rel_err(got, ref))
    # no adapter row: no LoRABatch at all
    assert LoRABatch.from_rows([-1, -1], adapters) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_decode_stack_runs_the_adapters(lora_setup, dtype):
    """A decode step whose rows use four adapters and the base runs on the native decode
    stack (the updates inside it) and gives the module path's hidden states."""
    from duetserve.models.decoder import _UNBUILT
    from duetserve.models.native import ops
    if ops() is None:
        pytest.skip("native kernels not built here")
    _, paths, loaded = lora_setup
    model, bs = loaded.model, 4
    adapters = [load_adapter(p, loaded.config, max_rank=16, dtype=dtype) for p in paths]
    slots = [2, -1, 0, 3, 1]
    kv = allocate_kv_cache(loaded.config, 64, bs, torch.float32, "cpu")
    paged = getattr(model.layers[0].self_attn.backend, "paged_decode", None) is not None
    work = [SeqWork(str(i), p, 0, list(range(4 * i, 4 * i + 4)), True, lora_slot=s)
            for i, (p, s) in enumerate(zip(PROMPTS, slots))]
    prefill = build_step_batch(work, bs)
    decode = build_step_batch(
        [SeqWork(str(i), [7 + i], len(p), list(range(4 * i, 4 * i + 4)), True, lora_slot=s)
         for i, (p, s) in enumerate(zip(PROMPTS, slots))],
        bs, paged_decode=paged, as_rows=chunk_rows(paged))
    saved, out = model._stack, {}
    try:
        with torch.inference_mode():
            model(prefill.input_ids, prefill.positions, kv, prefill.meta,
                  LoRABatch.from_rows(prefill.lora_slots, adapters))
            for use_stack in (True, False):
                model._stack = _UNBUILT if use_stack else None
                out[use_stack] = model(decode.input_ids, decode.positions, kv, decode.meta,
                                       LoRABatch.from_rows(decode.lora_slots, adapters))
                if use_stack:
                    assert model._stack is not None and model._stack.calls == 1
            plain = model(decode.input_ids, decode.positions, kv, decode.meta, None)
    finally:
        model._stack = saved
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[True][1], plain[1])                  # the base row
    assert not torch.allclose(out[True][0], plain[0], atol=1e-3)  # an adapter row


def test_scaling_and_fused_layout(lora_setup):
    _, paths, loaded = lora_setup
    cfg = loaded.config
    full = load_adapter(paths[1], cfg, max_rank=16)      # r=8, alpha=16, rsLoRA
    assert full.rank == 8 and full.scaling == pytest.approx(16 / 8 ** 0.5)
    a, bt, spans, _, _ = full.layers[0]["qkv"]
    assert a.shape == (3 * 8, cfg.hidden_size)
    q, kv = cfg.q_size, cfg.kv_size
    pad16 = lambda n: -(-n // 16) * 16                   # noqa: E731  (parts pad to 16)
    assert bt.shape == ((pad16(q) + 2 * pad16(kv)) // 16, 8, 16)   # tiles of 16 columns
    assert spans.tolist() == [[0, q], [q, q + kv], [q + kv, q + 2 * kv]]
    part = load_adapter(paths[3], cfg, max_rank=16)      # q, v and up only
    assert part.scaling == pytest.approx(3 / 6)
    assert set(part.layers[0]) == {"qkv", "gate_up"}
    a, bt, spans, _, _ = part.layers[0]["qkv"]
    assert a.shape == (2 * 6, cfg.hidden_size) and bt.shape == ((pad16(q) + pad16(kv)) // 16, 6, 16)
    assert spans.tolist() == [[0, q], [q + kv, q + 2 * kv]]          # k untouched
    i = cfg.intermediate_size
    assert part.layers[0]["gate_up"].spans.tolist() == [[i, 2 * i]]  # gate untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_native_update_equals_torch(lora_setup, dtype):
    """csrc/lora.cpp's grouped update (every adapter of a step in one call) against the
    torch loop, rows of four adapters interleaved with base rows, float32, bfloat16 and
    int8 weights; bfloat16 and int8 weights change the update by their rounding only."""
    from duetserve.models.native import ops
    if ops() is None:
        pytest.skip("native kernels not built here")
    _, paths, loaded = lora_setup
    cfg = loaded.config
    adapters = [load_adapter(p, cfg, max_rank=16, dtype=dtype) for p in paths]
    g = torch.Generator().manual_seed(0)
    slots = [2, -1, 0, 3, 1, 1, -1, 0, 3]
    for linear, fan_in, out in (("qkv", cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size),
                                ("gate_up", cfg.hidden_size, 2 * cfg.intermediate_size),
                                ("down", cfg.intermediate_size, cfg.hidden_size)):
        x = torch.randn(len(slots), fan_in, generator=g)
        y0 = torch.randn(len(slots), out, generator=g)
        batch = LoRABatch.from_rows(slots, adapters)
        native, plain = y0.clone(), y0.clone()
        batch.apply(1, linear, x, native)
        batch._native = None
        batch.apply(1, linear, x, plain)
        torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-5)
        assert torch.equal(native[[1, 6]], y0[[1, 6]])          # base rows untouched
        assert not torch.equal(native[0], y0[0])
    if dtype != torch.float32:        # the same update as float32 weights, to their rounding
        f32 = [load_adapter(p, cfg, max_rank=16) for p in paths]
        x = torch.randn(len(slots), cfg.hidden_size, generator=g)
        ya, yb = (torch.zeros(len(slots), cfg.q_size + 2 * cfg.kv_size) for _ in range(2))
        LoRABatch.from_rows(slots, adapters).apply(1, "qkv", x, ya)
        LoRABatch.from_rows(slots, f32).apply(1, "qkv", x, yb)
        assert rel_err(ya, yb) < 1e-2


# -- bad adapters ------------------------------------------------------------------------

def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def _edit_weights(path: str, fn) -> None:
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = fn(load_file(file))
    save_file(tensors, file)


def test_bad_adapters_name_the_problem(lora_setup, tmp_path):
    _, paths, loaded = lora_setup
    cfg = loaded.config

    def fails(path: str, match: str, max_rank: int = 16) -> None:
        with pytest.raises(LoRAError, match=match):
            load_adapter(path, cfg, max_rank)
        with pytest.raises(LoRAError, match=match):        # the header-only check too
            load_adapter(path, cfg, max_rank, weights=False)

    fails(str(tmp_path / "nowhere"), "is not a folder")
    p = _copy(paths[0], tmp_path / "no_config")
    os.remove(os.path.join(p, "adapter_config.json"))
    fails(p, "has no adapter_config.json")
    p = _copy(paths[0], tmp_path / "no_weights")
    os.remove(os.path.join(p, "adapter_model.safetensors"))
    fails(p, "has no adapter_model.safetensors")
    p = _copy(paths[0], tmp_path / "bad_json")
    with open(os.path.join(p, "adapter_config.json"), "w") as f:
        f.write("{not json")
    fails(p, "malformed adapter_config.json")
    p = _copy(paths[0], tmp_path / "bad_tensors")
    with open(os.path.join(p, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    fails(p, "malformed adapter_model.safetensors")
    fails(paths[1], r"rank 8, above the limit of 4 \(max_lora_rank\)", max_rank=4)
    p = _copy(paths[0], tmp_path / "dora")
    _edit_config(p, use_dora=True)
    fails(p, "DoRA is not supported")
    p = _copy(paths[0], tmp_path / "targets")
    _edit_config(p, target_modules=["q_proj", "c_attn"])
    fails(p, r"targets module\(s\) \['c_attn'\] the model does not have")
    p = _copy(paths[0], tmp_path / "lm_head")
    _edit_weights(p, lambda t: {**t, "base_model.model.lm_head.lora_A.weight":
                                torch.zeros(4, cfg.hidden_size)})
    fails(p, "'base_model.model.lm_head.lora_A.weight' targets a module the model does not")
    p = _copy(paths[0], tmp_path / "layers")
    _edit_weights(p, lambda t: {k.replace("layers.2.", "layers.7."): v for k, v in t.items()})
    fails(p, "is for layer 7, the model has 3 layers")
    p = _copy(paths[0], tmp_path / "shape")      # made for a wider base model
    _edit_weights(p, lambda t: {k: torch.zeros(v.shape[0], 2 * v.shape[1])
                                if "q_proj.lora_A" in k else v for k, v in t.items()})
    fails(p, r"does not fit the model \(a different base model\?\).*q_proj.lora_A.weight' "
             r"is \[4, 128\], the model needs \[4, 64\]")
    p = _copy(paths[0], tmp_path / "half")
    _edit_weights(p, lambda t: {k: v for k, v in t.items() if "layers.1.mlp.down_proj.lora_B"
                                not in k})
    fails(p, "layer 1 has lora_A of a module without its other half")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_lowbit_base_with_adapter(lora_setup, dtype):
    """The QLoRA serving case: int8 base weights, a float32 or int8 (the engine's choice on
    a low-bit base) adapter. Its error against the float32 merged reference stays at the
    low-bit base's own error against its float32 reference, and it is far from the base
    without the adapter."""
    base, paths, _ = lora_setup
    loaded = load_model(base, quantization="int8")
    assert loaded.quant_summary.get("int8")                  # the linears are low-bit
    adapter = load_adapter(paths[0], loaded.config, max_rank=16, dtype=dtype)
    prompt = PROMPTS[0]
    base_err = rel_err(_last_logits(loaded, [prompt], [-1], [])[0],
                       _reference(base, None, prompt))
    ours = _last_logits(loaded, [prompt], [0], [adapter])[0]
    ref = _reference(base, paths[0], prompt)
    assert rel_err(ours, ref) < 2 * base_err + 1e-3, (rel_err(ours, ref), base_err)
    assert rel_err(ours, _reference(base, None, prompt)) > 10 * base_err
