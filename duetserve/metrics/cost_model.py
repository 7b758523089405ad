"""Phase-cost model: FLOPs and bytes moved by one engine step of a decoder of any family
(models/families/: Llama, Qwen2/3, Mistral, Gemma 3, Mixtral, Qwen3-MoE, Qwen2-MoE).

Pure arithmetic on a `ModelConfig`; no torch. A *step* is a list of
`(num_new_tokens, context_len_before_step)`, one pair per request:

    request r:  [ 0 ........ c-1 | c ........ c+n-1 ]
                  context (in KV)   new tokens this step

What is counted (2 FLOPs per multiply-add):
- linear layers per new token: q, k, v, o projections (GQA sizes); the gated MLP (gate,
  up, down) of a dense layer; in a mixture-of-experts layer the router (hidden x experts)
  plus the num_experts_per_tok chosen experts of moe_intermediate_size and the shared
  expert (and its gate) where the model has one: the ACTIVE parameters, not all experts.
- attention: QK^T and AV, each 2 * num_heads * head_dim per (query, key) pair; causal, so
  new token i of a request attends to c + i + 1 positions, at most W of them in a
  sliding-window layer (config.attention_pairs).
- lm head: 2 * hidden * vocab per position that needs logits (default one per request).
- NOT counted: norms (Gemma's four a layer and QK-norm included), RoPE, softmax, the
  activation (SiLU or GELU-tanh: a few FLOPs per intermediate element against 2 x hidden
  for the projections, so the family does not matter), residual adds, bias adds, the
  top-k and renormalisation of the router (all O(hidden) per token).

Bytes:
- weights are read once per step at their stored dtype. The embedding table is gathered:
  only the rows of this step's tokens count, unless it is tied with the lm head, in which
  case it is read in full for the head (when any position needs logits).
- experts: a step reads each expert that at least one of its rows chose. Assuming every
  row picks its k of E experts uniformly and independently (real routers are skewed,
  which reads fewer), an expert is missed by all T rows with probability (1 - k/E)^T, so
  a step reads E * (1 - (1 - k/E)^T) experts of every MoE layer in expectation
  (`expert_read_fraction`): k at T = 1, all of them once T >> E/k.
- KV cache: each request's context is read once per step (flash-style kernels reuse it
  across the request's new tokens): c tokens in a full-attention layer, min(c, W - 1) in
  a sliding one (the W keys of its first new token's window, less that token itself); the
  new tokens' K and V are written in every layer (n tokens), not read back. What a request holds (`kv_bytes_held`) follows the cache's KV groups: a sliding
  group keeps at most its window.
- activations are NOT counted (small next to weights at low batch; say so in reports).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from duetserve.config import ConfigError, ModelConfig, attention_pairs

# Bits per stored weight. GGUF block types: (block bytes * 8) / weights per block.
BITS_PER_WEIGHT: dict[str, float] = {
    "f32": 32.0,
    "f16": 16.0,
    "bf16": 16.0,
    "fp8": 8.0,        # e4m3 / e5m2, per-tensor scale ignored
    "int8": 8.0,
    "int4": 4.5,       # the int4 KV cache: 32 x 4 bit + f16 scale (as q4_0)
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
    layers: int          # all decoder layers: projections, biases, norms, routers, experts
    final_norm: int
    lm_head: int         # 0 when tied with the embedding
    experts: int = 0     # of `layers`: every routed expert of every MoE layer
    active_experts: int = 0   # of `experts`: the num_experts_per_tok one token runs

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.lm_head

    @property
    def non_embedding(self) -> int:
        """Parameters read in full every step (everything but the gathered embedding; all
        experts included)."""
        return self.layers + self.final_norm + self.lm_head

    @property
    def active(self) -> int:
        """Parameters one token runs through: the total less the experts it did not choose
        (the figure MoE models publish as "activated"; equal to `total` for a dense one)."""
        return self.total - self.experts + self.active_experts


def linear_params_per_token(cfg: ModelConfig) -> dict[str, int]:
    """Weights of the linear layers ONE token multiplies through, summed over the layers,
    per kind: the attention projections, the dense MLP of the non-MoE layers, and in the
    MoE layers the router, its k chosen experts and the shared expert (active only)."""
    d, q, kv, layers = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.num_hidden_layers
    num_moe = len(cfg.moe_layer_ids)
    num_dense = layers - num_moe
    out = {"q_proj": d * q * layers, "k_proj": d * kv * layers, "v_proj": d * kv * layers,
           "o_proj": q * d * layers}
    if num_dense:
        inter = cfg.intermediate_size
        out.update(gate_proj=d * inter * num_dense, up_proj=d * inter * num_dense,
                   down_proj=inter * d * num_dense)
    if num_moe:
        out["router"] = d * cfg.num_experts * num_moe
        out["experts"] = 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok * num_moe
        if cfg.shared_expert_intermediate_size:
            out["shared_expert"] = 3 * d * cfg.shared_expert_intermediate_size * num_moe
            if cfg.shared_expert_gate:
                out["shared_expert_gate"] = d * num_moe
    return out


def param_count(cfg: ModelConfig) -> ParamCount:
    """Return the parameter counts of `cfg` (matches the published totals of Llama, Qwen2,
    Qwen3, Qwen3-MoE and Gemma 3)."""
    d, num_moe = cfg.hidden_size, len(cfg.moe_layer_ids)
    linear = linear_params_per_token(cfg)
    experts = 3 * d * cfg.moe_intermediate_size * cfg.num_experts * num_moe
    active_experts = linear.get("experts", 0)
    norms = (4 if cfg.norm_placement == "sandwich" else 2) * d
    if cfg.qk_norm:
        norms += 2 * cfg.head_dim
    bias = cfg.q_size + 2 * cfg.kv_size if cfg.has_qkv_bias else 0
    layers = (sum(linear.values()) - active_experts + experts
              + (norms + bias) * cfg.num_hidden_layers)
    embedding = cfg.vocab_size * cfg.hidden_size
    return ParamCount(embedding=embedding, layers=layers, final_norm=cfg.hidden_size,
                      lm_head=0 if cfg.tie_word_embeddings else embedding,
                      experts=experts, active_experts=active_experts)


def expert_read_fraction(num_experts: int, experts_per_tok: int, num_rows: int) -> float:
    """Expected fraction of a MoE layer's experts that a step of `num_rows` rows reads:
    1 - (1 - k/E)^rows, each row choosing its k of E uniformly and independently (module
    docstring); 0.0 for a model without experts or a step without rows."""
    if not num_experts or num_rows <= 0:
        return 0.0
    return 1.0 - (1.0 - experts_per_tok / num_experts) ** num_rows


def attention_flops_per_pair(cfg: ModelConfig) -> tuple[int, int]:
    """FLOPs of QK^T and AV per (query, key) pair, summed over (full-attention layers,
    sliding-window layers)."""
    per_layer = 2 * 2 * cfg.num_attention_heads * cfg.head_dim
    sliding = cfg.num_sliding_layers
    return per_layer * (cfg.num_hidden_layers - sliding), per_layer * sliding


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "f16") -> float:
    """Return KV cache bytes per token of a `kv_dtype` cache in every layer (what a new
    token writes; ModelConfig's formula)."""
    return cfg.kv_bytes_per_token(bytes_per_element(kv_dtype))


def kv_bytes_per_token_sliding(cfg: ModelConfig, kv_dtype: str = "f16") -> float:
    """The share of kv_bytes_per_token that lies in sliding-window layers (0.0 without):
    ModelConfig.kv_bytes_per_token's 2 x kv_heads x head_dim x bytes per sliding layer."""
    return 2 * cfg.num_sliding_layers * cfg.kv_size * bytes_per_element(kv_dtype)


def kv_bytes_held(cfg: ModelConfig, num_tokens: int, kv_dtype: str = "f16",
                  block_size: int | None = None) -> float:
    """Return the KV bytes one request of `num_tokens` tokens in the cache (its latest
    query at num_tokens - 1, as in a decode step) holds, per KV group (ModelConfig.
    kv_groups; a block holds kv_layers_per_block layer slots, padding included): a full
    group every token, a sliding group of window W the last W, which that query reads.
    `block_size`: count the whole blocks the paged cache holds (core/kv_cache_manager.py
    has released a sliding group's blocks before the one holding position
    num_tokens - W); None: exact tokens, min(num_tokens, W)."""
    slot_bytes = 2 * cfg.kv_size * bytes_per_element(kv_dtype)
    total = 0.0
    for group in cfg.kv_groups():
        if block_size is None:
            tokens = num_tokens if group.window is None else min(num_tokens, group.window)
        else:
            num_blocks = -(-num_tokens // block_size)
            if group.window is not None:
                num_blocks -= max(0, num_tokens - group.window) // block_size
            tokens = num_blocks * block_size
        total += tokens * cfg.kv_layers_per_block * slot_bytes
    return total


def kv_bytes_per_request(cfg: ModelConfig, num_tokens: int, kv_dtype: str = "f16") -> float:
    """Return KV cache bytes held by one request of `num_tokens` tokens (kv_bytes_held,
    exact tokens)."""
    return kv_bytes_held(cfg, num_tokens, kv_dtype)


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


def _flops_terms(cfg: ModelConfig, step: Sequence[tuple[int, int]], num_tokens: int,
                 num_logits: int) -> list[tuple[str, int]]:
    terms = [(name, 2 * p * num_tokens) for name, p in linear_params_per_token(cfg).items()]
    full, sliding = attention_flops_per_pair(cfg)
    pairs = sum(attention_pairs(n, c) for n, c in step) * full
    if sliding:
        pairs += sum(attention_pairs(n, c, cfg.sliding_window) for n, c in step) * sliding
    # NOTE: per_pair counts scores and values together; each is half of it
    terms += [("attn_scores", pairs // 2), ("attn_values", pairs // 2),
              ("lm_head", 2 * cfg.hidden_size * cfg.vocab_size * num_logits)]
    return terms


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
    flops_terms = _flops_terms(cfg, step, num_tokens, num_logits)
    # --- bytes ---
    params = param_count(cfg)
    bpp = (weight_bytes / params.total) if weight_bytes is not None else bits_per_weight(wdtype) / 8
    table = cfg.vocab_size * cfg.hidden_size * bpp
    head = table if num_logits else 0.0
    # NOTE: tied -> the shared table is read in full for the head and the gather hits the
    # same bytes, so rows are only counted when the head is not run.
    rows_read = not (cfg.tie_word_embeddings and num_logits)
    embed = min(num_tokens, cfg.vocab_size) * cfg.hidden_size * bpp if rows_read else 0.0
    byte_terms = [("weights.layers", (params.layers - params.experts) * bpp)]
    if params.experts:
        frac = expert_read_fraction(cfg.num_experts, cfg.num_experts_per_tok, num_tokens)
        byte_terms.append(("weights.experts", params.experts * frac * bpp))
    byte_terms += [("weights.final_norm", params.final_norm * bpp),
                   ("weights.lm_head", head), ("weights.embedding", embed)]
    kv_tok = kv_bytes_per_token(cfg, kv_dtype)
    kv_sliding = kv_bytes_per_token_sliding(cfg, kv_dtype)
    read = [(n, c) for n, c in step if n > 0]
    kv_read = (kv_tok - kv_sliding) * sum(c for _, c in read)
    if kv_sliding:
        kv_read += kv_sliding * sum(min(c, cfg.sliding_window - 1) for _, c in read)
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
