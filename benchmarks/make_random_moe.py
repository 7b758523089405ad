"""A random-weight mixture-of-experts GGUF of realistic proportions, for speed comparisons
with llama.cpp on a real-sized file (no real MoE checkpoint is reachable here).

    .venv/bin/python benchmarks/make_random_moe.py --out out/moe/random-moe-q4_k.gguf

Qwen3-MoE's architecture (`qwen3moe`: QK-norm, top-k of many small experts, renormalised)
at a Qwen3-30B-A3B-like ratio of active to total parameters: 24 layers, hidden 1024,
16 query heads and 4 KV heads of 128, 128 experts of 512 with 8 chosen per token, the
Qwen2.5 tokenizer (copied from the Qwen2.5-Coder GGUF, 151,936 tokens, tied head).
About 5.1 G parameters, 0.55 G active per token (~11%): 2.9 GB at Q4_K (attention and
experts Q4_K, expert down projections Q6_K, as llama.cpp's Q4_K_M keeps them; embedding
Q6_K). Blocks are random bytes with small fixed super-block scales, written straight in
their K-quant layout (no float copy of the model ever exists), so a run takes a minute.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = dict(layers=24, hidden=1024, heads=16, kv_heads=4, head_dim=128, experts=128,
             expert_ff=512, top_k=8, dense_ff=3072, context=32768)


def kquant(qtype, rows: int, cols: int, rng, scale: float = 2e-4) -> np.ndarray:
    """Random K-quant blocks [rows, bytes] with the super-block scales set to `scale`
    (weights of a few hundredths: activations stay finite through 24 layers)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    d = np.full((raw.shape[0], 1), scale, np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[:, -2:] = d
    else:
        raw[:, 0:2] = d
        raw[:, 2:4] = d
    return raw.reshape(rows, -1)


def copy_tokenizer(writer: gguf.GGUFWriter, source: str) -> None:
    """Every tokenizer.* key of `source` (a GGUF), with its stored types."""
    sys.path.insert(0, os.path.join(HERE, "peers"))
    from make_f32_gguf import field_value
    reader = gguf.GGUFReader(source)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            value, vtype, sub = field_value(field)
            writer.add_key_value(name, value, vtype, sub_type=sub)


def write(path: str, tokenizer_gguf: str, seed: int = 0) -> None:
    s, rng = SHAPE, np.random.default_rng(seed)
    d, hd = s["hidden"], s["head_dim"]
    arch = "qwen3moe"
    w = gguf.GGUFWriter(path, arch)
    for key, value in {"block_count": s["layers"], "context_length": s["context"],
                       "embedding_length": d, "feed_forward_length": s["dense_ff"],
                       "attention.head_count": s["heads"],
                       "attention.head_count_kv": s["kv_heads"],
                       "attention.key_length": hd, "attention.value_length": hd,
                       "expert_count": s["experts"], "expert_used_count": s["top_k"],
                       "expert_feed_forward_length": s["expert_ff"]}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 1e6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    copy_tokenizer(w, tokenizer_gguf)
    vocab = len(gguf.GGUFReader(tokenizer_gguf).fields["tokenizer.ggml.tokens"].data)
    ones = lambda n: np.ones(n, np.float32)    # noqa: E731
    w.add_tensor("token_embd.weight", kquant(Q.Q6_K, vocab, d, rng, 4e-4), raw_dtype=Q.Q6_K)
    w.add_tensor("output_norm.weight", ones(d))
    q, kv, e, ff = s["heads"] * hd, s["kv_heads"] * hd, s["experts"], s["expert_ff"]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        for name, rows, cols in (("attn_q", q, d), ("attn_k", kv, d), ("attn_v", kv, d),
                                 ("attn_output", d, q)):
            w.add_tensor(b + name + ".weight", kquant(Q.Q4_K, rows, cols, rng),
                         raw_dtype=Q.Q4_K)
        for name, n in (("attn_norm", d), ("ffn_norm", d), ("attn_q_norm", hd),
                        ("attn_k_norm", hd)):
            w.add_tensor(b + name + ".weight", ones(n))
        w.add_tensor(b + "ffn_gate_inp.weight",
                     rng.standard_normal((e, d), dtype=np.float32) * 0.05)
        # experts stacked [experts, rows, cols] (numpy order), raw blocks per expert row
        for name, rows, cols, qt in (("ffn_gate_exps", ff, d, Q.Q4_K),
                                     ("ffn_up_exps", ff, d, Q.Q4_K),
                                     ("ffn_down_exps", d, ff, Q.Q6_K)):
            blocks = kquant(qt, e * rows, cols, rng)
            w.add_tensor(b + name + ".weight", blocks.reshape(e, rows, -1), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/moe/random-moe-q4_k.gguf")
    ap.add_argument("--tokenizer-from", default=None,
                    help="a GGUF whose tokenizer is copied (default: Qwen2.5-Coder-1.5B "
                         "from ../shared/models/fetch.sh)")
    args = ap.parse_args()
    source = args.tokenizer_from or subprocess.run(
        ["bash", os.path.join(HERE, "..", "..", "shared", "models", "fetch.sh"),
         "qwen2.5-coder-1.5b"], check=True, capture_output=True, text=True).stdout.strip()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write(args.out, source)
    print(f"{args.out}: {os.path.getsize(args.out) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
