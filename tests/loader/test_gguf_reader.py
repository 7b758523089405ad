"""The lean GGUF reader (loader/gguf_reader.py) against the `gguf` library's GGUFReader:
the same metadata values, the same tensor index and data, the same vocabulary; damaged
files fail with a CheckpointError naming what is wrong."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from duetserve.errors import CheckpointError
from duetserve.loader.gguf_file import gguf_model_config, open_gguf
from duetserve.loader.tokenizer import Tokenizer


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def _assert_same_as_gguf(path: str) -> None:
    ref = gguf.GGUFReader(path)
    lean = open_gguf(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert lean.keys() == keys
    for key in keys:
        want, got = ref.fields[key].contents(), _plain(lean.get(key))
        assert got == want and type(got) is type(want), key
    assert len(lean.tensors) == len(ref.tensors)
    for a, b in zip(ref.tensors, lean.tensors):
        assert (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset) == \
            (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset)
        assert list(b.shape) == [int(d) for d in a.shape]
        assert b.data.shape == a.data.shape and b.data.dtype == a.data.dtype
        assert np.array_equal(np.asarray(b.data), np.asarray(a.data)), a.name


def test_default_model_same_as_gguf_reader(default_model_path):
    _assert_same_as_gguf(default_model_path)


def test_default_model_vocabulary_same_as_gguf_reader(default_model_path):
    """The tokenizer built from the lean reader has exactly the vocabulary, added and
    special tokens that gguf's parsing of the same file gives."""
    ref = gguf.GGUFReader(default_model_path)
    tokens = ref.fields["tokenizer.ggml.tokens"].contents()
    types = ref.fields["tokenizer.ggml.token_type"].contents()
    merges = ref.fields["tokenizer.ggml.merges"].contents()
    lean = open_gguf(default_model_path)
    assert lean.get("tokenizer.ggml.tokens") == tokens
    assert lean.get("tokenizer.ggml.merges") == merges
    assert lean.get("tokenizer.ggml.token_type").tolist() == types
    assert lean.array_len("tokenizer.ggml.tokens") == len(tokens)

    tok = Tokenizer.from_gguf(lean, gguf_model_config(lean, default_model_path))
    assert tok.tok.get_vocab(with_added_tokens=True) == {t: i for i, t in enumerate(tokens)}
    added = {i: (t.content, t.special) for i, t in tok.tok.get_added_tokens_decoder().items()}
    assert added == {i: (tokens[i], ty == 3) for i, ty in enumerate(types) if ty in (3, 4)}
    assert added                                   # the default model has control tokens
    bos = ref.fields["tokenizer.ggml.bos_token_id"].contents()
    assert tok.special_tokens["bos_token"] == tokens[bos]
    assert tok.decode(tok.encode("Hello, world!", add_special_tokens=False)) == "Hello, world!"


def _write(path: str, fill, endianess=gguf.GGUFEndian.LITTLE) -> None:
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_same_as_gguf_reader(tmp_path):
    path = str(tmp_path / "kinds.gguf")
    Q = gguf.GGMLQuantizationType

    def fill(w):
        w.add_uint8("t.u8", 200)
        w.add_int8("t.i8", -5)
        w.add_uint16("t.u16", 60000)
        w.add_int16("t.i16", -30000)
        w.add_uint32("t.u32", 4_000_000_000)
        w.add_int32("t.i32", -2_000_000_000)
        w.add_uint64("t.u64", 2**63 + 5)
        w.add_int64("t.i64", -2**62)
        w.add_float32("t.f32", 1e-6)
        w.add_float64("t.f64", 1e-300)
        w.add_bool("t.bool", True)
        w.add_string("t.str", "h\u00e9llo \u2603")
        w.add_string("t.empty", "")
        w.add_array("t.strs", ["a", "", "\u0120the", "x y"])
        w.add_array("t.ints", [1, -2, 3])
        w.add_array("t.floats", [0.5, -1.25])
        w.add_array("t.bools", [True, False])
        w.add_array("t.none", [])
        w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
        w.add_tensor("q8", gguf.quants.quantize(np.ones((2, 64), np.float32), Q.Q8_0),
                     raw_dtype=Q.Q8_0)
    _write(path, fill)
    _assert_same_as_gguf(path)
    lean = open_gguf(path)
    assert lean.get("t.ints").dtype == np.int32 and lean.get("t.strs")[2] == "\u0120the"
    assert lean.get("t.missing", 7) == 7 and lean.array_len("t.str") is None
    assert lean.get("t.strs") is not lean.get("t.strs")    # decoded afresh, not cached


def test_truncated_header_names_the_byte(tmp_path, default_model_path):
    p = tmp_path / "head.gguf"
    with open(default_model_path, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(100_000))      # inside the vocabulary
    with pytest.raises(CheckpointError, match="GGUF file is truncated: the header needs"):
        open_gguf(str(p))


def test_big_endian_refused(tmp_path):
    path = str(tmp_path / "be.gguf")
    _write(path, lambda w: w.add_tensor("x", np.ones(32, np.float32)),
           endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(CheckpointError, match="big-endian GGUF files are not supported"):
        open_gguf(path)


def test_unknown_value_type(tmp_path):
    path = str(tmp_path / "bad.gguf")
    _write(path, lambda w: w.add_uint32("t.x", 1))
    raw = bytearray(open(path, "rb").read())
    at = raw.index(b"t.x") + 3                  # the value type follows the key
    raw[at:at + 4] = (77).to_bytes(4, "little")
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match="unknown GGUF value type 77"):
        open_gguf(path)
