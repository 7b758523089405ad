"""LoRA adapters in the PEFT format on the one decoder, and the low-rank update of the rows
of a step that use them.

An adapter folder holds adapter_config.json (r, lora_alpha, target_modules, use_rslora)
and adapter_model.safetensors: per targeted module of layer N, `...layers.N.self_attn.
q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]; the module's output gains
scaling * B(A x), scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).

The decoder fuses q|k|v into qkv_proj and gate|up into gate_up_proj (models/decoder.py),
so an adapter keeps, per layer and fused linear, one shrink matrix (the A of each part it
targets, stacked: [parts * r, in]), one expand matrix (each part's B, scaled, transposed,
side by side: [r, sum of the parts' sizes]) and the parts' output rows ([parts, 2]).
Weights are float32, bfloat16 or int8 (`--lora-dtype`: a half or a quarter of the bytes a
step with adapters reads) whatever the base's (low-bit GGUF included); int8 keeps a
float32 scale per row of A and per output row of B (absmax / 127). The update of a step's
rows runs in one native call per linear (csrc/lora.cpp: every adapter of the step,
grouped; inside the native decode stack on decode steps), or in torch where the native
kernels are not built.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

from duetserve.config import ModelConfig
from duetserve.errors import LoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LINEARS = ("qkv", "o", "gate_up", "down")    # the fused linears, in csrc/lora.cpp's order
# PEFT module name -> (the decoder's fused linear, the part of its output)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
           "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "down_proj": ("down", 0)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")
# adapter_config.json fields that change the update in ways not supported here
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save",
                "rank_pattern": "per-module ranks (rank_pattern)",
                "alpha_pattern": "per-module alphas (alpha_pattern)"}


def linear_shapes(cfg: ModelConfig, layer_id: int) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """Each fused linear of a layer: (input features, [(first, end) output row of each
    part]); the MLP's only on dense-MLP layers (an expert's are not adapted)."""
    q, kv, d, i = cfg.q_size, cfg.kv_size, cfg.hidden_size, cfg.intermediate_size
    out = {"qkv": (d, [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]), "o": (q, [(0, d)])}
    if not cfg.is_moe_layer(layer_id):
        out.update(gate_up=(d, [(0, i), (i, 2 * i)]), down=(i, [(0, d)]))
    return out


class LinearLoRA(NamedTuple):
    """One fused linear's update: A [parts * r, in]; Bt, the parts' B scaled and transposed
    side by side ([r, C]: each part's columns padded to a multiple of 16), stored in tiles
    of 16 columns [C / 16, r, 16] (the native expand reads it as one stream); spans
    [parts, 2] int64 (each part's (first, end) output row); int8 weights only: a_scale
    [parts * r] and bt_scale [C] float32, else None."""

    a: torch.Tensor
    bt: torch.Tensor
    spans: torch.Tensor
    a_scale: torch.Tensor | None = None
    bt_scale: torch.Tensor | None = None

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [parts * r, in], Bt [r, C]) in float32, untiled."""
        tiles, r, _ = self.bt.shape
        bt = self.bt.float().permute(1, 0, 2).reshape(r, tiles * 16)
        if self.a_scale is None:
            return self.a.float(), bt
        return self.a.float() * self.a_scale[:, None], bt * self.bt_scale


@dataclass
class LoRAAdapter:
    """One adapter's weights, laid out for the decoder. layers[N]: {fused linear:
    LinearLoRA}, only the targeted ones."""

    path: str
    rank: int
    scaling: float
    layers: list[dict[str, LinearLoRA]]
    native: object = None      # its csrc NativeLoRA, made at first use (LoRABatch)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for w in layer.values() for t in w if t is not None)


def read_config(path: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from PATH/adapter_config.json. Raises LoRAError naming the problem."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {path!r} is not a folder")
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {path!r}: malformed {CONFIG_FILE}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {path!r}: peft_type {cfg.get('peft_type')!r} is not "
                        "supported (LORA only)")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {path!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {path!r}: trained biases (bias={cfg['bias']!r}) are "
                        "not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if type(r) is not int or r < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"LoRA adapter {path!r}: {CONFIG_FILE} needs an integer rank r >= 1 "
                        f"and a number lora_alpha, got r={r!r}, lora_alpha={alpha!r}")
    if r > max_rank:
        raise LoRAError(f"LoRA adapter {path!r} has rank {r}, above the limit of {max_rank} "
                        "(max_lora_rank)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(t for t in targets if str(t).rsplit(".", 1)[-1] not in TARGETS)
        if bad:
            raise LoRAError(f"LoRA adapter {path!r} targets module(s) {bad} the model does "
                            f"not have (supported: {', '.join(TARGETS)})")
    return r, alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def load_adapter(path: str, cfg: ModelConfig, max_rank: int, weights: bool = True,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check an adapter against the model: every tensor must be a LoRA A or B of
    a linear the decoder has, in a layer it has, of the shapes its linears take and the
    config's rank. `weights=False`: check shapes only (the file's header), return an
    adapter with no layers. `dtype`: the weights' (float32, bfloat16 or int8). Raises
    LoRAError naming the problem."""
    path = os.path.abspath(path)
    rank, scaling = read_config(path, max_rank)
    parts = _read_parts(path, cfg, rank, weights)
    layers: list[dict] = [{} for _ in range(cfg.num_hidden_layers)]
    if weights:
        for (layer_id, linear), pieces in sorted(parts.items()):
            layers[layer_id][linear] = _fuse(cfg, layer_id, linear, pieces, scaling, dtype)
    return LoRAAdapter(path, rank, scaling, layers if weights else [])


def _read_parts(path: str, cfg: ModelConfig, rank: int, weights: bool) -> dict:
    """{(layer, fused linear): {part: {"A"/"B": tensor or None}}}, shapes checked."""
    from safetensors import SafetensorError, safe_open
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    parts: dict = {}
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                layer_id, linear, part, ab = _parse_key(path, key, cfg)
                shape = tuple(f.get_slice(key).get_shape())
                _check_shape(path, key, cfg, layer_id, linear, part, ab, shape, rank)
                parts.setdefault((layer_id, linear), {}).setdefault(part, {})[ab] = \
                    f.get_tensor(key).float() if weights else None
    except SafetensorError as e:
        raise LoRAError(f"LoRA adapter {path!r}: malformed {WEIGHTS_FILE}: {e}") from None
    if not parts:
        raise LoRAError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    for (layer_id, linear), pieces in parts.items():
        for part, ab in pieces.items():
            if len(ab) != 2:
                raise LoRAError(f"LoRA adapter {path!r}: layer {layer_id} has lora_"
                                f"{next(iter(ab))} of a module without its other half")
    return parts


def _parse_key(path: str, key: str, cfg: ModelConfig) -> tuple[int, str, int, str]:
    m = _KEY.search(key)
    if m is None or m.group(2) not in TARGETS:
        raise LoRAError(f"LoRA adapter {path!r}: tensor {key!r} targets a module the model "
                        f"does not have (supported: {', '.join(TARGETS)})")
    layer_id = int(m.group(1))
    linear, part = TARGETS[m.group(2)]
    if layer_id >= cfg.num_hidden_layers:
        raise LoRAError(f"LoRA adapter {path!r} does not fit the model: tensor {key!r} is for "
                        f"layer {layer_id}, the model has {cfg.num_hidden_layers} layers")
    if linear not in linear_shapes(cfg, layer_id):
        raise LoRAError(f"LoRA adapter {path!r}: tensor {key!r} adapts a mixture-of-experts "
                        "MLP, which is not supported")
    return layer_id, linear, part, m.group(3)


def _check_shape(path: str, key: str, cfg: ModelConfig, layer_id: int, linear: str,
                 part: int, ab: str, shape: tuple, rank: int) -> None:
    fan_in, rows = linear_shapes(cfg, layer_id)[linear]
    want = (rank, fan_in) if ab == "A" else (rows[part][1] - rows[part][0], rank)
    if shape != want:
        raise LoRAError(f"LoRA adapter {path!r} does not fit the model (a different base "
                        f"model?): tensor {key!r} is {list(shape)}, the model needs "
                        f"{list(want)} (rank {rank})")


def _fuse(cfg: ModelConfig, layer_id: int, linear: str, pieces: dict, scaling: float,
          dtype: torch.dtype) -> LinearLoRA:
    """A stacked, Bt of the parts side by side and scaled, spans of one fused linear's
    targeted parts, in part order."""
    _, rows = linear_shapes(cfg, layer_id)[linear]
    order = sorted(pieces)
    a = torch.cat([pieces[p]["A"] for p in order])
    bt = torch.cat([torch.nn.functional.pad((pieces[p]["B"] * scaling).T,
                                            (0, _pad16(rows[p][1] - rows[p][0])))
                    for p in order], 1)
    spans = torch.tensor([rows[p] for p in order], dtype=torch.long)
    if dtype != torch.int8:
        return LinearLoRA(a.to(dtype).contiguous(), _tiles(bt.to(dtype)), spans)
    qa, sa = _int8(a, 1)
    qbt, sbt = _int8(bt, 0)
    return LinearLoRA(qa, _tiles(qbt), spans, sa, sbt)


def _pad16(n: int) -> int:
    """Columns that pad n to a multiple of 16."""
    return -n % 16


def _tiles(bt: torch.Tensor) -> torch.Tensor:
    """[r, C] -> [C / 16, r, 16]"""
    r, c = bt.shape
    return bt.reshape(r, c // 16, 16).permute(1, 0, 2).contiguous()


def _int8(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w as int8 and its float32 scales, one per slice along `dim` (absmax / 127)."""
    scale = w.abs().amax(dim, keepdim=True).clamp_min(1e-30) / 127
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale.flatten().float().contiguous()


class LoRABatch:
    """The adapters of one step's rows, grouped: `apply` adds each adapter's update to its
    rows of a linear's output; rows without an adapter are untouched."""

    def __init__(self, groups: list[tuple[LoRAAdapter, list[int]]]) -> None:
        self.groups = groups
        self.rows = torch.tensor([r for _, rows in groups for r in rows], dtype=torch.long)
        self.offsets = [0]
        for _, rows in groups:
            self.offsets.append(self.offsets[-1] + len(rows))
        from duetserve.models.native import ops
        self._native = ops()
        self._offsets = torch.tensor(self.offsets, dtype=torch.long)
        self._adapters = [native_form(a, self._native) for a, _ in groups] \
            if self._native is not None else []

    @property
    def native(self) -> bool:
        """Whether the updates run in csrc/lora.cpp (the native decode stack can run them)."""
        return self._native is not None

    def native_args(self) -> tuple[list, torch.Tensor, torch.Tensor]:
        """(the groups' NativeLoRA, rows, offsets [G + 1]) as csrc's lora_apply takes them."""
        return self._adapters, self.rows, self._offsets

    @classmethod
    def from_rows(cls, row_slots: list[int], adapters: list[LoRAAdapter | None]
                  ) -> "LoRABatch | None":
        """row_slots[i]: the adapter slot of row i (-1: none); adapters: each slot's."""
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(row_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(i)
        if not by_slot:
            return None
        return cls([(adapters[s], rows) for s, rows in by_slot.items()])

    def apply(self, layer_id: int, linear: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += B(A x[rows]) for each adapter that targets `linear` of the layer.
        Mutates y."""
        if self._native is not None and x.dtype == y.dtype == torch.float32 and \
                x.is_contiguous() and y.is_contiguous():     # skips adapters without it
            self._native.lora_apply(x, y, self._adapters, layer_id, LINEARS.index(linear),
                                    self.rows, self._offsets)
            return
        used = [(i, a.layers[layer_id][linear]) for i, (a, _) in enumerate(self.groups)
                if linear in a.layers[layer_id]]
        for i, w in used:
            rows = self.rows[self.offsets[i]:self.offsets[i + 1]]
            a, bt = w.dequantized()
            u = x.index_select(0, rows).float() @ a.T                # [n, parts * r]
            r, at = bt.shape[0], 0
            for p, (start, end) in enumerate(w.spans.tolist()):
                delta = u[:, p * r:(p + 1) * r] @ bt[:, at:at + end - start]
                y[:, start:end].index_add_(0, rows, delta.to(y.dtype))
                at += end - start + _pad16(end - start)


def native_form(adapter: LoRAAdapter, native) -> object:
    """The adapter's csrc NativeLoRA (made once, kept on the adapter)."""
    if adapter.native is None:
        form = native.NativeLoRA(len(adapter.layers))
        for layer_id, linears in enumerate(adapter.layers):
            for linear, w in linears.items():
                form.set(layer_id, LINEARS.index(linear), *w)
        adapter.native = form
    return adapter.native
