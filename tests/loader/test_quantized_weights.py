"""Low-bit weights kept low-bit: the packed forms equal gguf's dequantization of the same
tensors, exactly where the format maps losslessly and within the stated bound where it
is repacked (models/quant.py)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from gguf_helpers import k_quant_blocks

from duetserve.loader import load_model
from duetserve.loader.gguf_blocks import GGUFTensor
from duetserve.loader.gguf_file import open_gguf
from duetserve.models.quant import (Int4KWeight, Int4Weight, Int6Weight, Int8GWeight, Int8Weight,
                                    QuantEmbedding, QuantLinear, int4_groups_from_float,
                                    quantize_int8)

ROWS, COLS = 64, 512      # int4 packing works in blocks of 64 rows


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("qw") / "q.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for qt in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1):
        w.add_tensor(qt.name, quants.quantize(rng.standard_normal((ROWS, COLS))
                                              .astype(np.float32), qt), raw_dtype=qt)
    for qt in (Q.Q4_K, Q.Q6_K):
        w.add_tensor(qt.name, k_quant_blocks(qt, ROWS, COLS, rng), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t.name: t for t in open_gguf(path).tensors}


def _reference(t) -> np.ndarray:
    return quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(ROWS, COLS)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_groups_are_exact(quant_file, name):
    t = quant_file[name]
    q, d, m = GGUFTensor(name, t).int4_groups()
    assert q.dtype == np.uint8 and q.max() <= 15
    w = (q.astype(np.float32) * np.repeat(d, 32, 1) + np.repeat(m, 32, 1))
    ref = _reference(t)
    # the same float32 arithmetic as gguf's dequantization: exact
    np.testing.assert_array_equal(w, ref)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_packed_int4_within_f16_scale_bound(quant_file, name):
    """Q4_0 / Q4_1 pack losslessly (their d and m are float16 in the file); Q4_K's
    d * sc and -dmin * mn are rounded to float16 (models/quant.py states the bound)."""
    t = quant_file[name]
    q, d, m = GGUFTensor(name, t).int4_groups()
    packed = Int4Weight(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
    got = packed.dequantize().numpy()
    ref = _reference(t)
    if name in ("Q4_0", "Q4_1"):
        np.testing.assert_array_equal(got, ref)
    else:
        bound = 2.0 ** -11 * (q * np.repeat(np.abs(d), 32, 1) + np.repeat(np.abs(m), 32, 1)) \
            + 2.0 ** -24
        assert np.all(np.abs(got.astype(np.float64) - ref) <= bound)
    ids = torch.tensor([0, 1, 31, 32, 33, 63])
    assert torch.equal(packed.rows(ids), packed.dequantize()[ids])


def test_q4_k_packs_exactly(quant_file):
    """Q4_K's own codes and scales survive packing: gguf's dequantization, bit for bit."""
    src = GGUFTensor("Q4_K", quant_file["Q4_K"])
    q, sc, mn, d, dmin = src.q4_k_parts()
    assert sc.max() <= 63 and mn.max() <= 63
    packed = Int4KWeight(q, sc, mn, d, dmin)
    np.testing.assert_array_equal(packed.dequantize().numpy(), _reference(quant_file["Q4_K"]))
    ids = torch.tensor([0, 1, 31, 32, 33, 63])
    assert torch.equal(packed.rows(ids), packed.dequantize()[ids])
    assert packed.nbytes == ROWS * COLS * 9 // 16       # 4.5 bits a weight: the file's size
    assert torch.equal(packed.prefix(33).dequantize(), packed.dequantize()[:33])


def test_q6_k_packs_exactly(quant_file):
    """Q6_K's own numbers (q, sc, d) survive packing: the dequantization is gguf's, bit
    for bit, through the packed form, whole and by rows."""
    src = GGUFTensor("Q6_K", quant_file["Q6_K"])
    q, sc, d = src.q6_k_parts()
    assert q.dtype == np.uint8 and q.max() <= 63 and sc.dtype == np.int8
    packed = Int6Weight.from_q6_k(q, sc, d)
    back = packed.parts(torch.arange(ROWS))
    assert torch.equal(back[0], torch.from_numpy(q)) and torch.equal(back[1], torch.from_numpy(sc))
    np.testing.assert_array_equal(packed.dequantize().numpy(), _reference(quant_file["Q6_K"]))
    ids = torch.tensor([0, 1, 31, 32, 33, 63])
    assert torch.equal(packed.rows(ids), packed.dequantize()[ids])
    assert packed.nbytes == ROWS * COLS * 53 // 64      # 6.625 bits a weight


@pytest.mark.parametrize("forms", ["exact", "widened"])
def test_k_quant_forms_follow_the_measured_choice(quant_file, monkeypatch, forms):
    """auto packs Q4_K / Q6_K exactly (int4k / int6) when their kernels measured faster,
    else widened (int4 / int8); the choice is in the load summary. Other types and
    stacked parts that differ are not affected."""
    from duetserve.loader.quantize import QuantPlan
    plan = QuantPlan("auto", kquant_forms=forms)
    part = {name: [(0, GGUFTensor(name, quant_file[name]))] for name in ("Q4_K", "Q6_K", "Q4_0")}
    want = {"exact": ("int4k", "int6"), "widened": ("int4", "int8")}[forms]
    assert (plan._form(part["Q4_K"]), plan._form(part["Q6_K"])) == want
    assert plan._form(part["Q4_0"]) == "int4"
    mixed = [(0, part["Q4_K"][0][1]), (1, part["Q6_K"][0][1])]      # a mixed stacked target
    assert plan._form(mixed) == ("stacked" if forms == "exact" else "int8")
    assert plan.summary["k_quants"].startswith(f"Q4_K as {want[0]}, Q6_K as {want[1]}")
    w = plan.build(part["Q6_K"], (ROWS, COLS))
    assert isinstance(w, Int6Weight if forms == "exact" else Int8Weight)


def test_k_quant_exact_form_kept_at_a_near_tie(quant_file, monkeypatch):
    """A measured near tie keeps the exact form (the file's values, fewer bytes); only a
    widened form measured clearly faster (EXACT_UNLESS_WIDENED_FASTER) replaces it."""
    from duetserve.loader import quantize
    monkeypatch.setattr("duetserve.models.kernels.exact_kquant_forms",
                        lambda choice: {"Q4_K": 1.03, "Q6_K": 1.2})
    plan = quantize.QuantPlan("auto")
    part = {name: [(0, GGUFTensor(name, quant_file[name]))] for name in ("Q4_K", "Q6_K")}
    assert 1.03 < quantize.EXACT_UNLESS_WIDENED_FASTER < 1.2
    assert (plan._form(part["Q4_K"]), plan._form(part["Q6_K"])) == ("int4k", "int8")
    assert plan.summary["k_quants"].startswith("Q4_K as int4k, Q6_K as int8")


def test_mixed_stacked_target_keeps_each_part_exact(quant_file, monkeypatch):
    """A stacked target whose parts differ (Q4_K q and k beside a Q6_K v, as in Q4_K_M
    files) packs each run of parts in its own exact form, in the parts' order: the whole
    dequantizes to gguf's values bit for bit, and its product is each part's product.
    Q8_0 beside Q4_K is a run of its own (int8g); a part with no exact form (Q6_K when
    its int8 widening measured faster) makes the whole target int8."""
    from duetserve.loader.quantize import QuantPlan
    from duetserve.models.quant import StackedWeight
    t = {name: GGUFTensor(name, quant_file[name]) for name in ("Q4_K", "Q6_K", "Q4_0", "Q8_0")}
    plan = QuantPlan("auto", kquant_forms="exact")
    w = plan.build([(2, t["Q6_K"]), (0, t["Q4_K"]), (1, t["Q4_K"])], (3 * ROWS, COLS))
    assert isinstance(w, StackedWeight) and w.shape == (3 * ROWS, COLS)
    assert [type(p) for p in w.parts] == [Int4KWeight, Int6Weight]
    assert w.parts[0].shape == (2 * ROWS, COLS) and w.bits == "4k/6"
    ref = np.concatenate([_reference(quant_file[n]) for n in ("Q4_K", "Q4_K", "Q6_K")])
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)
    assert torch.equal(w.dequantize(torch.float32, ROWS + 3, 2 * ROWS + 5),
                       torch.from_numpy(ref[ROWS + 3:2 * ROWS + 5]))
    assert w.nbytes == sum(p.nbytes for p in w.parts)
    for rows in (1, 3):
        x = torch.randn(rows, COLS)
        assert torch.equal(w.matmul(x), torch.cat([p.matmul(x) for p in w.parts], dim=1))
    w = plan.build([(0, t["Q4_0"]), (1, t["Q6_K"])], (2 * ROWS, COLS))
    assert [type(p) for p in w.parts] == [Int4Weight, Int6Weight]
    w = plan.build([(0, t["Q4_K"]), (1, t["Q8_0"])], (2 * ROWS, COLS))
    assert [type(p) for p in w.parts] == [Int4KWeight, Int8GWeight]
    ref = np.concatenate([_reference(quant_file[n]) for n in ("Q4_K", "Q8_0")])
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)
    monkeypatch.setattr("duetserve.loader.quantize._keeps_exact", lambda ratio: False)
    widened = QuantPlan("auto", kquant_forms="exact")
    assert isinstance(widened.build([(0, t["Q6_K"]), (1, t["Q8_0"])], (2 * ROWS, COLS)),
                      Int8Weight)
    assert plan.summary["stacked"] == 3 and widened.summary["int8"] == 1


@pytest.mark.parametrize("names", [("Q8_0",), ("Q5_0",), ("Q5_1",), ("Q5_0", "Q5_0", "Q8_0"),
                                   ("Q4_0", "Q8_0")])
def test_byte_group_types_pack_exactly(quant_file, names):
    """Q8_0 and Q5_x (alone, or stacked like Gemma 3 files' Q5_0 q and k beside a Q8_0 v,
    or with Q4_0) pack into int8g: gguf's dequantization bit for bit, rows and row
    slices included, and its product is the int8-activation product of those values."""
    from duetserve.loader.quantize import QuantPlan
    plan = QuantPlan("auto", kquant_forms="exact")
    parts = [(i, GGUFTensor(n, quant_file[n])) for i, n in enumerate(names)]
    w = plan.build(parts, (len(names) * ROWS, COLS))
    assert isinstance(w, Int8GWeight) and plan.summary == {"int8g": 1}
    ref = np.concatenate([_reference(quant_file[n]) for n in names])
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)
    n = len(names) * ROWS
    np.testing.assert_array_equal(w.dequantize(torch.float32, 3, n - 5).numpy(), ref[3:n - 5])
    np.testing.assert_array_equal(w.rows(torch.tensor([7, 0, 7])).numpy(), ref[[7, 0, 7]])
    x = torch.randn(2, COLS, dtype=torch.float64)
    g = x.view(2, -1, 32)
    dx = g.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(g / dx) * dx).view(2, COLS)
    torch.testing.assert_close(w.matmul(x.float()).double(), xq @ torch.from_numpy(ref).double().t(),
                               atol=1e-4, rtol=1e-5)


def test_half_overflowing_scale_falls_back_to_int8(quant_file, monkeypatch):
    """A Q8_0 group whose -128 d is past float16's range has no int8g form: int8 per row."""
    from duetserve.loader import quantize
    t = GGUFTensor("Q8_0", quant_file["Q8_0"])
    u, d, m = t.int8_groups()
    m = m.copy()
    m[3, 2] = np.inf
    monkeypatch.setattr(GGUFTensor, "int8_groups", lambda self, a=0, b=None: (u[a:b], d[a:b], m[a:b]))
    w = quantize.QuantPlan("auto").build([(0, t)], (ROWS, COLS))
    assert isinstance(w, Int8Weight)


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0", "Q6_K"])
def test_int8_requantization_bound(quant_file, name):
    """What int8 keeps of formats it repacks (Q6_K only in a stacked target whose parts
    differ)."""
    ref = _reference(quant_file[name])
    packed = Int8Weight(*quantize_int8(torch.from_numpy(ref)))
    got = packed.dequantize().double().numpy()
    amax = np.abs(ref).max(axis=1, keepdims=True)
    # half a step of the row's scale, plus the bfloat16 rounding of the scale
    bound = amax / 254 * (1 + 2.0 ** -7) + 2.0 ** -8 * np.abs(ref) + 1e-7
    assert np.all(np.abs(got - ref) <= bound)
    assert not np.array_equal(got, ref) or name == "Q8_0"   # it is a real requantization


def test_int4_from_float_bound():
    w = torch.randn(64, 128)
    q, d, m = int4_groups_from_float(w)
    back = Int4Weight(q, d, m).dequantize()
    step = d.repeat_interleave(32, 1)
    # half a step, plus the float16 rounding of d and m
    assert torch.all((back - w).abs() <= step / 2 + 2.0 ** -11 * (15 * step + m.abs()
                                                                   .repeat_interleave(32, 1)))


def test_default_model_packed_like_the_file(default_model):
    """Q4_1 projections -> int4, the tied Q8_0 embedding/head -> int8g; every packed
    weight equal to the float load of the same file (stacking and the Q/K row order
    included)."""
    q = load_model(None, quantization="auto")
    dense = dict(default_model.model.named_parameters())
    seen = 0
    for name, mod in q.model.named_modules():
        if not isinstance(mod, QuantLinear) or name == "lm_head":
            continue
        ref = dense[name + ".weight"]
        qw = mod.qweight
        assert isinstance(qw, Int4Weight), name
        # Q4_1 packs losslessly: the float load of the same file, exactly
        assert torch.equal(qw.dequantize(), ref), name
        seen += 1
    assert seen == 4 * q.config.num_hidden_layers
    assert isinstance(q.model.embed_tokens, QuantEmbedding)
    assert q.model.lm_head.qweight is q.model.embed_tokens.qweight       # tied, one copy
    emb = dense["embed_tokens.weight"]
    head = q.model.lm_head.qweight
    assert isinstance(head, Int8GWeight)
    assert torch.equal(head.dequantize(), emb)     # Q8_0 packs losslessly too
    ids = torch.tensor([0, 5, 49151])
    assert torch.equal(q.model.embed_tokens(ids), head.dequantize()[ids])
    assert q.weight_bytes < 0.35 * default_model.weight_bytes     # low-bit, not float32


def test_kernel_paths_agree():
    """The low-bit kernel (few rows) and the dense path (many rows) compute the same
    product, up to bfloat16 activations."""
    from duetserve.models.quant import KernelPolicy
    w = torch.randn(128, 256)
    q6 = Int6Weight(torch.randint(0, 64, (128, 256), dtype=torch.uint8),
                    torch.randint(-128, 128, (128, 16), dtype=torch.int8),
                    torch.full((128, 2), 1e-3, dtype=torch.float16))
    q4k = Int4KWeight(torch.randint(0, 16, (128, 256), dtype=torch.uint8),
                      torch.randint(0, 64, (128, 8), dtype=torch.uint8),
                      torch.randint(0, 64, (128, 8), dtype=torch.uint8),
                      torch.full((128, 1), 1e-2, dtype=torch.float16),
                      torch.full((128, 1), 1e-2, dtype=torch.float16))
    for qw in (Int4Weight(*int4_groups_from_float(w)), Int8Weight(*quantize_int8(w)), q6, q4k):
        for dense in (None, qw.dequantize(torch.bfloat16)):
            policy = KernelPolicy(lowbit_max_rows=4, dense_dtype=torch.bfloat16)
            lin = QuantLinear(qw, torch.randn(128), policy, dense)
            x = torch.randn(8, 256)
            many = lin(x)                                  # 8 rows > 4: dense path
            few = torch.cat([lin(x[i:i + 1]) for i in range(8)])   # low-bit kernel
            ref = x @ qw.dequantize().t() + lin.bias
            for y in (many, few):
                assert (y - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_rows_read_from_the_file_are_exact(quant_file, name):
    """The embedding lookup that reads the file: any ids (unordered, repeated) decode to
    gguf's dequantization of those rows, bit for bit; a row past the table is an error."""
    t = quant_file[name]
    ref = _reference(t)
    ids = np.array([5, 0, 63, 5, 17])
    np.testing.assert_array_equal(GGUFTensor(name, t).rows(ids), ref[ids])
    perm = np.arange(ROWS)[::-1].copy()          # a Q/K-style row permutation applies too
    np.testing.assert_array_equal(GGUFTensor(name, t, perm).rows(ids), ref[perm[ids]])
    with pytest.raises(IndexError, match=r"\[0, 64\)"):
        GGUFTensor(name, t).rows(np.array([ROWS]))


def test_untied_gguf_embedding_is_read_from_the_file(tiny_checkpoints, tmp_path):
    """An untied GGUF embedding is not packed (it is only looked up): the model's
    embedding decodes rows from the file's memory map, equal to gguf's dequantization."""
    from duetserve.loader.hf_folder import hf_model_config, iter_safetensors
    from duetserve.loader.quantize import QuantPlan
    from duetserve.loader.weights import load_weights
    from duetserve.models.quant import FileEmbedding
    from duetserve.models.registry import model_class

    folder = tiny_checkpoints["llama-gqa-untied"]
    cfg = hf_model_config(folder)
    tensors = dict(iter_safetensors(folder))
    emb = tensors["model.embed_tokens.weight"].numpy()
    path = str(tmp_path / "emb.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", quants.quantize(emb, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = open_gguf(path).tensors[0]
    tensors["model.embed_tokens.weight"] = GGUFTensor(t.name, t)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    plan = QuantPlan("auto")
    load_weights(model, tensors.items(), cfg, torch.float32, quant=plan)
    assert isinstance(model.embed_tokens, FileEmbedding)
    assert plan.summary["embedding"] == "rows from the file"
    ids = torch.tensor([[3, 299, 3], [0, 1, 2]])
    ref = quants.dequantize(np.asarray(t.data), Q.Q8_0).reshape(emb.shape)
    got = model.embed_tokens(ids)
    assert got.shape == (2, 3, cfg.hidden_size)
    assert torch.equal(got, torch.from_numpy(ref)[ids])
    assert not any(p.device.type == "meta" for p in model.parameters())


def _mapped_kib(path: str) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    import os

    real, total, cur = os.path.realpath(path), 0, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                cur = parts[5] if len(parts) > 5 else ""
            elif parts[0] == "Rss:" and cur == real:
                total += int(parts[1])
    return total


def _big_gguf(tmp_path) -> str:
    path = str(tmp_path / "big.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("x", np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024))
    w.add_tensor("q", quants.quantize(np.arange(256 * 1024, dtype=np.float32)
                                      .reshape(256, 1024) / 1e5, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_drop_mapped_pages_unmaps_what_was_read(tmp_path):
    """After repacking, the file's pages read so far leave the process's resident set
    (the map's Rss in /proc/self/smaps), and the data still reads back the same."""
    from duetserve.loader.gguf_file import drop_mapped_pages

    path = _big_gguf(tmp_path)
    reader = open_gguf(path)
    total = float(np.asarray(reader.tensors[0].data).sum())
    assert _mapped_kib(path) >= 1024          # 1 MiB of tensor data read: mapped
    drop_mapped_pages(reader)
    assert _mapped_kib(path) == 0
    assert float(np.asarray(reader.tensors[0].data).sum()) == total
    assert _mapped_kib(path) >= 1024          # read again: mapped again


def test_rows_are_read_without_mapping_the_file(tmp_path):
    """The embedding lookup reads its rows with pread: exact, and none of the file's
    pages become resident in the process (through the map they would, 64 KiB around
    each row)."""
    from duetserve.loader.gguf_file import drop_mapped_pages

    path = _big_gguf(tmp_path)
    reader = open_gguf(path)
    drop_mapped_pages(reader)                 # what the header parse touched
    ids = np.array([200, 3, 4, 5, 3, 255, 0, 128])      # runs, repeats, any order
    for t in reader.tensors:
        ref = quants.dequantize(np.array(t.data), t.tensor_type).reshape(256, 1024)
        drop_mapped_pages(reader)
        got = GGUFTensor(t.name, t).rows(ids)
        assert _mapped_kib(path) == 0, t.name
        np.testing.assert_array_equal(got, ref[ids])


def test_packing_by_row_chunks_equals_packing_at_once():
    """A K-quant weight packed chunk by chunk of rows (how the loader packs big matrices,
    to bound its intermediates) is byte for byte the weight packed at once, including a
    last chunk that is not a whole block of rows."""
    g = torch.Generator().manual_seed(0)
    n, k = 75, 512           # 4 blocks of 16 rows + 11; two 256-column units, 4 128-units

    def rand(hi, *shape, dtype=torch.uint8):
        return torch.randint(0, hi, shape, generator=g, dtype=torch.int32).to(dtype)
    q6 = (rand(64, n, k), (rand(256, n, k // 16) - 128).to(torch.int8),
          torch.rand(n, k // 128, generator=g).to(torch.float16))
    q4k = (rand(16, n, k), rand(64, n, k // 32), rand(64, n, k // 32),
           torch.rand(n, k // 256, generator=g).to(torch.float16),
           torch.rand(n, k // 256, generator=g).to(torch.float16))
    for cls, parts in ((Int6Weight, q6), (Int4KWeight, q4k)):
        whole = cls(*parts)
        cuts = [(0, 32), (32, 64), (64, n)]
        chunked = cls.from_row_chunks(n, k, (cls(*(p[a:b] for p in parts))
                                             for a, b in cuts))
        assert chunked.shape == whole.shape
        assert torch.equal(chunked.packed, whole.packed), cls.__name__
        assert torch.equal(chunked.dequantize(), whole.dequantize())
