"""Phase-cost model: FLOPs and bytes moved by one engine step of a Llama-family decoder.

Pure arithmetic on a `ModelConfig`; no torch. A *step* is a list of
`(num_new_tokens, context_len_before_step)`, one pair per request:

    request r:  [ 0 ........ c-1 | c ........ c+n-1 ]
                  context (in KV)   new tokens this step

What is counted (2 FLOPs per multiply-add):
- linear layers per new token: q, k, v, o projections (GQA sizes) and gate, up, down.
- attention: QK^T and AV, each 2 * num_heads * head_dim per (query, key) pair; causal, so
  new token i of a request attends to c + i + 1 positions.
- lm head: 2 * hidden * vocab per position that needs logits (default one per request).
- NOT counted: norms, RoPE, softmax, SiLU, residual adds, bias adds (all O(hidden) per token).

Bytes:
- weights are read once per step at their stored dtype. The embedding table is gathered:
  only the rows of this step's tokens count, unless it is tied with the lm head, in which
  case it is read in full for the head (when any position needs logits).
- KV cache: each request's context (c tokens) is read once per step (flash-style kernels
  reuse it across the request's new tokens); the new tokens' K and V are written
  (n tokens), not read back.
- activations are NOT counted (small next to weights at low batch; say so in reports).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from duetserve.config import ConfigError, ModelConfig

# Bits per stored weight. GGUF block types: (block bytes * 8) / weights per block.
BITS_PER_WEIGHT: dict[str, float] = {
    "f32": 32.0,
    "f16": 16.0,
    "bf16": 16.0,
    "fp8": 8.0,        # e4m3 / e5m2, per-tensor scale ignored
    "int8": 8.0,
    "q8_0": 34 * 8 / 32,     # 8.5: f16 scale + 32 x int8
    "q4_0": 18 * 8 / 32,     # 4.5: f16 scale + 32 x 4 bit
    "q4_1": 20 * 8 / 32,     # 5.0: f16 scale + f16 min + 32 x 4 bit
    "q5_0": 22 * 8 / 32,     # 5.5
    "q5_1": 24 * 8 / 32,     # 6.0
    "q2_k": 84 * 8 / 256,    # 2.625 (super-block of 256)
    "q3_k": 110 * 8 / 256,   # 3.4375
    "q4_k": 144 * 8 / 256,   # 4.5
    "q5_k": 176 * 8 / 256,   # 5.5
    "q6_k": 210 * 8 / 256,   # 6.5625
}

_ALIASES = {
    "float32": "f32", "fp32": "f32",
    "float16": "f16", "fp16": "f16", "half": "f16",
    "bfloat16": "bf16",
    "float8": "fp8", "f8": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8",
}


# storage dtype (normalised) -> compute dtype of the hardware peak table
COMPUTE_DTYPE_OF = {"f32": "fp32", "f16": "fp16", "bf16": "bf16", "fp8": "fp8"}


def normalise_dtype(dtype: str) -> str:
    """Return the canonical short name ("bf16", "q4_1", ...) of a storage dtype name."""
    name = dtype.strip().lower().replace("torch.", "")
    name = _ALIASES.get(name, name)
    if name not in BITS_PER_WEIGHT:
        raise ConfigError(
            f"unknown dtype {dtype!r}; known: {', '.join(BITS_PER_WEIGHT)} "
            f"(aliases: {', '.join(_ALIASES)})")
    return name


def bits_per_weight(dtype: str) -> float:
    """Return the stored bits per weight (element) of `dtype`, e.g. 5.0 for "q4_1"."""
    return BITS_PER_WEIGHT[normalise_dtype(dtype)]


def bytes_per_element(dtype: str) -> float:
    """Return the stored bytes per element of `dtype` (may be fractional for GGUF types)."""
    return bits_per_weight(dtype) / 8


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a model, split by where they live."""

    embedding: int       # vocab x hidden
    layers: int          # all decoder layers: projections, biases, both norms
    final_norm: int
    lm_head: int         # 0 when tied with the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.lm_head

    @property
    def non_embedding(self) -> int:
        """Parameters read in full every step (everything but the gathered embedding)."""
        return self.layers + self.final_norm + self.lm_head


def layer_linear_params(cfg: ModelConfig) -> dict[str, int]:
    """Return the weight-matrix parameter count of ONE decoder layer, per projection."""
    d, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": d * q, "k_proj": d * kv, "v_proj": d * kv, "o_proj": q * d,
            "gate_proj": d * inter, "up_proj": d * inter, "down_proj": inter * d}


def param_count(cfg: ModelConfig) -> ParamCount:
    """Return the parameter counts of `cfg` (matches the published totals of Llama/Qwen2)."""
    per_layer = sum(layer_linear_params(cfg).values()) + 2 * cfg.hidden_size  # 2 RMSNorms
    if cfg.has_qkv_bias:
        per_layer += cfg.q_size + 2 * cfg.kv_size
    embedding = cfg.vocab_size * cfg.hidden_size
    return ParamCount(embedding=embedding, layers=per_layer * cfg.num_hidden_layers,
                      final_norm=cfg.hidden_size,
                      lm_head=0 if cfg.tie_word_embeddings else embedding)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "f16") -> float:
    """Return KV cache bytes per token of a `kv_dtype` cache (ModelConfig's formula)."""
    return cfg.kv_bytes_per_token(bytes_per_element(kv_dtype))


def kv_bytes_per_request(cfg: ModelConfig, num_tokens: int, kv_dtype: str = "f16") -> float:
    """Return KV cache bytes held by one request of `num_tokens` tokens."""
    return kv_bytes_per_token(cfg, kv_dtype) * num_tokens


@dataclass(frozen=True)
class StepWork:
    """FLOPs and bytes of one step. `flops_terms` / `byte_terms` hold the per-term breakdown."""

    flops: int
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    num_tokens: int
    num_logits: int
    flops_terms: tuple[tuple[str, int], ...] = ()
    byte_terms: tuple[tuple[str, float], ...] = ()

    @property
    def bytes(self) -> float:
        """Total bytes moved: weights + KV read + KV write (activations not counted)."""
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    total_bytes = bytes

    @property
    def ai(self) -> float:
        """Arithmetic intensity in FLOP/byte (0.0 for an empty step)."""
        return self.flops / self.bytes if self.bytes else 0.0

    def breakdown(self) -> dict[str, float]:
        """Return every FLOP term (key "flops.<term>") and byte term ("bytes.<term>")."""
        out: dict[str, float] = {f"flops.{k}": v for k, v in self.flops_terms}
        out.update({f"bytes.{k}": v for k, v in self.byte_terms})
        return out


def step_work(cfg: ModelConfig, step: Sequence[tuple[int, int]], *,
              num_logits: int | None = None, weight_dtype: str | None = None,
              kv_dtype: str | None = None, weight_bytes: float | None = None) -> StepWork:
    """Return the StepWork of one step of `cfg`.

    step: (num_new_tokens, context_len_before_step) per request.
    num_logits: positions that need logits; default one per request with new tokens.
    weight_dtype: stored dtype of the weights; default `cfg.weight_dtype`.
    kv_dtype: KV cache dtype; default the weight dtype if it is a float type, else f16.
    weight_bytes: total stored bytes of all weights (e.g. from a mixed-quant file); when
        given, bytes per parameter = weight_bytes / total params, overriding weight_dtype.
    """
    wdtype = normalise_dtype(weight_dtype or cfg.weight_dtype)
    if kv_dtype is None:
        kv_dtype = wdtype if wdtype in ("f32", "f16", "bf16", "fp8") else "f16"
    for n, c in step:
        if n < 0 or c < 0:
            raise ConfigError(f"step entries must be >= 0, got (new={n}, context={c})")
    num_tokens = sum(n for n, _ in step)
    if num_logits is None:
        num_logits = sum(1 for n, _ in step if n > 0)
    if num_logits < 0 or num_logits > num_tokens:
        raise ConfigError(f"num_logits must be in [0, {num_tokens}], got {num_logits}")

    params = param_count(cfg)
    layers, d, vocab = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    # --- FLOPs ---
    flops_terms = [(name, 2 * p * num_tokens * layers)
                   for name, p in layer_linear_params(cfg).items()]
    # (query, key) pairs: new token i attends to c + i + 1 keys -> n*c + n(n+1)/2 per request.
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in step)
    per_pair = 2 * cfg.num_attention_heads * cfg.head_dim * layers
    flops_terms += [("attn_scores", per_pair * pairs), ("attn_values", per_pair * pairs),
                    ("lm_head", 2 * d * vocab * num_logits)]
    # --- bytes ---
    bpp = (weight_bytes / params.total) if weight_bytes is not None else bits_per_weight(wdtype) / 8
    table = vocab * d * bpp
    head = table if num_logits else 0.0
    # NOTE: tied -> the shared table is read in full for the head and the gather hits the
    # same bytes, so rows are only counted when the head is not run.
    rows_read = not (cfg.tie_word_embeddings and num_logits)
    embed = min(num_tokens, vocab) * d * bpp if rows_read else 0.0
    byte_terms = [("weights.layers", params.layers * bpp),
                  ("weights.final_norm", params.final_norm * bpp),
                  ("weights.lm_head", head), ("weights.embedding", embed)]
    kv_tok = kv_bytes_per_token(cfg, kv_dtype)
    kv_read = kv_tok * sum(c for n, c in step if n > 0)
    kv_write = kv_tok * num_tokens
    byte_terms += [("kv_read", kv_read), ("kv_write", kv_write)]
    return StepWork(flops=sum(v for _, v in flops_terms),
                    weight_bytes=sum(v for k, v in byte_terms if k.startswith("weights.")),
                    kv_read_bytes=kv_read, kv_write_bytes=kv_write,
                    num_tokens=num_tokens, num_logits=num_logits,
                    flops_terms=tuple(flops_terms), byte_terms=tuple(byte_terms))


def prefill_step(prompt_len: int) -> list[tuple[int, int]]:
    """Return the step of one whole-prompt prefill: [(prompt_len, 0)]."""
    return [(prompt_len, 0)]


def decode_step(batch: int, context_len: int) -> list[tuple[int, int]]:
    """Return the step of `batch` decodes, one new token each after `context_len` tokens."""
    return [(1, context_len)] * batch
