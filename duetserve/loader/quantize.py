"""`--quantization auto|none|int8|int4`: which weights are packed low-bit, and how.

- auto: keep what the file has, at the nearest packed form. GGUF Q4_0/Q4_1 -> int4
  (exact groups of 32). Q4_K -> int4k (its own 6-bit codes, exact) and Q6_K -> int6
  (exact) unless the widened forms' kernels measured clearly faster on this CPU
  (Q4_K -> int4 with float16 d and m per group, Q6_K -> int8 per row;
  models/kernels.py: exact_kquant_forms), else widened; a stacked target whose parts
  differ (a Q6_K v beside Q4_K q and k) -> a `StackedWeight` of each part's form where
  every part has a 4- or 6-bit one; Q8_0, Q5_0 and Q5_1 -> int8g (exact: a byte a weight
  with float16 d and m per group of 32), also a stacked target mixing them with Q4_0/Q4_1;
  other quantized GGUF types (K-quants other than Q4_K/Q6_K), and stacked targets mixing
  in one of them -> int8 per row;
  float tensors (F32/F16/BF16 GGUF, HF folders) stay dense.
- int8 / int4: every linear weight (and the embedding) is packed so, quantizing float
  checkpoints at load (4-bit sources stay exact under int4).
- none: nothing is packed (the float path of `--dtype`).

A GGUF embedding that is not tied to the head is not packed: it is only looked up, so its
rows are decoded on demand from the file's memory map (`FileEmbedding`, exact), and the
table costs resident memory only for the pages of the tokens seen.

A stacked target (qkv, gate_up) is one form when its parts share it; otherwise each run
of parts of one form is packed in that form (`StackedWeight`), or, where a part has no
exact form, the whole target is int8. Parts are decoded in row chunks, so no whole tensor is ever held in
float32 (except for the dense copies a `KernelPolicy` asks for, see models/kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from duetserve.config import QUANTIZATIONS, ModelConfig  # noqa: F401 (re-exported)
from duetserve.loader.gguf_blocks import INT8G_TYPES, GGUFTensor
from duetserve.loader.huge_pages import release_free_memory
from duetserve.models.quant import (FileEmbedding, Int4KWeight, Int4Weight, Int6Weight,
                                    Int8GWeight, Int8Weight, KernelPolicy, QuantEmbedding, QuantLinear,
                                    QuantWeight, StackedWeight, int4_groups_from_float,
                                    quantize_int8)

_LINEAR_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight",
                    "down_proj.weight", "lm_head.weight", "embed_tokens.weight")
_FLOAT_TYPES = ("F32", "F16", "BF16")
_CHUNK = 8192      # rows decoded at a time
# An exact K-quant form is kept unless the widened one measured this much faster: the
# exact form keeps the file's values and reads fewer bytes, and the start-up probe's
# int4k / int4 ratio moves 0.93-1.03 between runs on one machine (2026-11-25), so a plain
# "< 1" made the format a coin toss.
EXACT_UNLESS_WIDENED_FASTER = 1.05


def _rows_float(arr, a: int, b: int) -> torch.Tensor:
    if isinstance(arr, GGUFTensor):
        return torch.from_numpy(arr.dequantize(a, b))
    if isinstance(arr, np.ndarray):
        return torch.from_numpy(np.array(arr[a:b], dtype=np.float32))
    return arr[a:b].float()


def _int4_rows(arr, a: int, b: int):
    if isinstance(arr, GGUFTensor) and arr.is_int4:
        q, d, m = arr.int4_groups(a, b)
        return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)
    return int4_groups_from_float(_rows_float(arr, a, b))


def _chunks(parts):
    for _, arr in sorted(parts, key=lambda p: p[0]):
        for a in range(0, arr.shape[0], _CHUNK):
            yield arr, a, min(arr.shape[0], a + _CHUNK)


class _NotHalfExact(ValueError):
    """A group's m (-128 d for Q8_0, -16 d for Q5_0) is past float16's range."""


def _int8g_parts(arr, a: int, b: int):
    u, d, m = arr.int8_groups(a, b)
    if not (np.isfinite(d).all() and np.isfinite(m).all()):
        raise _NotHalfExact(arr.name)
    return u, d, m


_BLOCK_FORMS = {   # form: (class, the exact parts of rows [a, b) of a GGUF tensor)
    "int4k": (Int4KWeight, lambda arr, a, b: arr.q4_k_parts(a, b)),
    "int6": (Int6Weight, lambda arr, a, b: arr.q6_k_parts(a, b)),
    "int8g": (Int8GWeight, _int8g_parts),
}


def _block_weight(form: str, parts) -> Int4KWeight | Int6Weight | Int8GWeight:
    """A run of parts packed in its exact block form (int4k from Q4_K, int6 from Q6_K,
    int8g from Q8_0 / Q5_x), chunk by chunk of _CHUNK rows when every part is a whole
    number of row blocks (the packing's intermediates are several times the packed size: a
    whole tied embedding at once would double the load's peak), else at once."""
    cls, exact_parts = _BLOCK_FORMS[form]

    def build(arr, a: int, b: int):
        p = exact_parts(arr, a, b)
        return Int6Weight.from_q6_k(*p) if form == "int6" else cls(*p)
    n = sum(arr.shape[0] for _, arr in parts)
    k = parts[0][1].shape[1]
    if all(arr.shape[0] % cls.ROWS == 0 for _, arr in parts) and _CHUNK % cls.ROWS == 0:
        return cls.from_row_chunks(n, k, (build(arr, a, b) for arr, a, b in _chunks(parts)))
    joined = [np.concatenate(p) for p in zip(
        *(exact_parts(arr, a, b) for arr, a, b in _chunks(parts)))]
    return Int6Weight.from_q6_k(*joined) if form == "int6" else cls(*joined)


def _drop_pages(parts) -> None:
    """The packed parts' file pages leave the process's resident set (GGUF sources), and
    the packing's freed intermediates leave glibc's heap (kept there they add up over the
    tensors to a third of the model on top of it)."""
    for _, arr in parts:
        if isinstance(arr, GGUFTensor):
            arr.drop_pages()
    release_free_memory()


def _keeps_exact(ratio: float) -> bool:
    """Is a K-quant kept in its exact form, given t(exact) / t(widened) measured here?"""
    return ratio < EXACT_UNLESS_WIDENED_FASTER


@dataclass
class QuantPlan:
    mode: str                              # auto | int8 | int4
    policy: KernelPolicy = field(default_factory=KernelPolicy)
    # Resident dense copies (for many-row steps) are kept when all of them fit this.
    dense_budget_bytes: int = 512 * 2**20
    summary: dict = field(default_factory=dict)   # form -> number of tensors (for logs)
    # {"Q4_K": t(exact) / t(widened), "Q6_K": ...} (kernels.exact_kquant_forms), measured
    # when a Q4_K or Q6_K tensor first needs a form; an exact form is used below
    # EXACT_UNLESS_WIDENED_FASTER.
    exact_ratio: dict | None = None
    kquant_forms: str = "measure"          # EngineConfig.kquant_forms

    def wants(self, target: str, arr) -> bool:
        """Is this part of `target` to be packed?"""
        if not target.endswith(_LINEAR_SUFFIXES):
            return False
        if self.mode == "auto":
            return isinstance(arr, GGUFTensor) and arr.type not in _FLOAT_TYPES
        return True

    def _form(self, parts) -> str:
        all4 = all(isinstance(a, GGUFTensor) and a.is_int4 for _, a in parts)
        if self.mode in ("auto", "int4") and self._exact(parts, "Q4_K"):
            return "int4k"
        if self.mode == "int4" or (self.mode == "auto" and all4):
            return "int4"
        if self.mode == "auto" and self._exact(parts, "Q6_K"):
            return "int6"
        if self.mode == "auto" and all(isinstance(a, GGUFTensor) and a.type in INT8G_TYPES
                                       for _, a in parts):
            return "int8g"
        if self.mode == "auto" and len(parts) > 1 and all(
                self._form([p]) in ("int4k", "int4", "int6", "int8g") for p in parts):
            return "stacked"
        return "int8"

    def _exact(self, parts, qtype: str) -> bool:
        """Are all parts `qtype` (rows of whole 256-blocks) and is its exact form not
        clearly slower here? Mutates: exact_ratio (measured on first need)."""
        if not all(isinstance(a, GGUFTensor) and a.type == qtype and a.shape[1] % 256 == 0
                   for _, a in parts):
            return False
        self.measure_kquant_forms()
        return _keeps_exact(self.exact_ratio[qtype])

    def measure_kquant_forms(self) -> None:
        """Decide the K-quants' forms (kernels.exact_kquant_forms: measured once per
        machine, ~100 MiB of probe weights) unless decided. The loader calls it before any
        weight is packed, so the probe's memory is gone before the weights arrive.
        Mutates: exact_ratio, summary."""
        if self.exact_ratio is None:
            from duetserve.models.kernels import exact_kquant_forms
            self.exact_ratio = r = exact_kquant_forms(self.kquant_forms)
            self.summary["k_quants"] = (
                f"Q4_K as {'int4k' if _keeps_exact(r['Q4_K']) else 'int4'}, Q6_K as "
                f"{'int6' if _keeps_exact(r['Q6_K']) else 'int8'}"
                + (f": exact-form GEMVs took {r['Q4_K']:.2f}x / {r['Q6_K']:.2f}x the "
                   "widened forms' time here" if 0 < r["Q4_K"] < 2 else ""))

    def build(self, parts, shape) -> QuantWeight:
        form = self._form(parts)
        self.summary[form] = self.summary.get(form, 0) + 1
        if form != "stacked":
            return self._packed(form, parts)
        # runs of consecutive parts of one form (q and k, then v), each packed in its form
        runs: list[tuple[str, list]] = []
        for part in sorted(parts, key=lambda p: p[0]):
            f = self._form([part])
            if runs and runs[-1][0] == f:
                runs[-1][1].append(part)
            else:
                runs.append((f, [part]))
        packed = [self._packed(f, run) for f, run in runs]
        if any(isinstance(p, Int8Weight) for p in packed):   # a run fell back (_NotHalfExact)
            return self._packed("int8", parts)
        return StackedWeight(packed)

    @staticmethod
    def _packed(form: str, parts) -> QuantWeight:
        if form == "int4":
            q, d, m = zip(*(_int4_rows(arr, a, b) for arr, a, b in _chunks(parts)))
            return Int4Weight(torch.cat(q), torch.cat(d), torch.cat(m))
        if form in _BLOCK_FORMS:
            try:
                return _block_weight(form, parts)
            except _NotHalfExact:     # a scale past float16's range: int8 per row below
                pass
        q, s = zip(*(quantize_int8(_rows_float(arr, a, b)) for arr, a, b in _chunks(parts)))
        return Int8Weight(torch.cat(q), torch.cat(s))

    def apply(self, model: nn.Module, pending: dict[str, list], buffers: dict[str, torch.Tensor],
              cfg: ModelConfig) -> None:
        """Mutates `model` (quantized targets' modules replaced; tied head added) and
        `buffers` (biases of replaced linears move into the new modules)."""
        params = dict(model.named_parameters())
        linears: list[QuantLinear] = []
        for target, parts in pending.items():
            path = target[: -len(".weight")]
            if path == "embed_tokens" and not cfg.tie_word_embeddings and len(parts) == 1 \
                    and isinstance(parts[0][1], GGUFTensor):
                # Only looked up, never multiplied: rows decoded from the file's memory map
                # on demand (exact), nothing packed or kept resident.
                src = parts[0][1]
                model.embed_tokens = FileEmbedding(src.rows, *src.shape)
                self.summary["embedding"] = "rows from the file"
                continue
            qw = self.build(parts, tuple(params[target].shape))
            _drop_pages(parts)
            if path == "embed_tokens":
                model.embed_tokens = QuantEmbedding(qw)
                if cfg.tie_word_embeddings:
                    model.lm_head = QuantLinear(qw, None, self.policy)
                    linears.append(model.lm_head)
                continue
            bias = buffers.pop(path + ".bias", None)
            mod = QuantLinear(qw, bias, self.policy)
            model.set_submodule(path, mod)
            linears.append(mod)
        dense_bytes = sum(m.out_features * m.in_features for m in linears) * \
            torch.empty(0, dtype=self.policy.dense_dtype).element_size()
        if dense_bytes <= self.dense_budget_bytes:
            for m in linears:
                m.dense = m.qweight.dequantize(self.policy.dense_dtype)
        self.summary["dense_copies"] = dense_bytes <= self.dense_budget_bytes
        self.summary["dense_bytes"] = dense_bytes
