"""Every supported GGUF tensor type round-trips through a real GGUF file and our reader."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from gguf_helpers import k_quant_blocks

from duetserve.errors import CheckpointError
from duetserve.loader.gguf_file import dequantize, open_gguf, unpermute_qk

ROWS, COLS = 4, 256
# Types gguf-py can quantize: compare with the original values within the type's error.
QUANTIZABLE = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 2e-2, Q.Q5_0: 0.15,
               Q.Q5_1: 0.15, Q.Q4_0: 0.3, Q.Q4_1: 0.3}
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def gguf_with_all_types(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("q") / "types.gguf")
    w = gguf.GGUFWriter(path, "llama")
    originals = {}
    for qt in QUANTIZABLE:
        x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        originals[qt.name] = x
        data = x if qt == Q.F32 else quants.quantize(x, qt)
        w.add_tensor(qt.name, data, raw_dtype=None if qt == Q.F32 else qt)
    for qt in K_QUANTS:
        raw = k_quant_blocks(qt, ROWS, COLS, rng)
        originals[qt.name] = quants.dequantize(raw, qt)
        w.add_tensor(qt.name, raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, originals


@pytest.mark.parametrize("qtype", list(QUANTIZABLE) + K_QUANTS, ids=lambda q: q.name)
def test_dequantize_type(qtype, gguf_with_all_types):
    path, originals = gguf_with_all_types
    tensor = next(t for t in open_gguf(path).tensors if t.name == qtype.name)
    assert tensor.tensor_type == qtype
    got = dequantize(tensor)
    assert got.shape == (ROWS, COLS) and got.dtype == np.float32
    assert np.isfinite(got).all()
    tol = QUANTIZABLE.get(qtype, 1e-6)
    assert np.abs(got - originals[qtype.name]).max() <= tol + 1e-7


def test_unknown_tensor_type_is_named():
    class FakeTensor:
        name = "blk.0.attn_q.weight"
        tensor_type = Q.IQ2_XXS
    with pytest.raises(CheckpointError, match="unsupported GGUF tensor type IQ2_XXS"):
        dequantize(FakeTensor())


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's converter: interleave the two rotate-half halves of each head.
    permuted = (w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2)
                .reshape(heads * head_dim, cols))
    assert np.array_equal(unpermute_qk(permuted, heads), w)
