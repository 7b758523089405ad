"""Frozen configuration objects: validated once at construction, never mutated.

`ModelConfig` describes a checkpoint's architecture (what the loader found);
`EngineConfig` holds the user's engine options (the CLI flags, also the keyword
arguments of `LLM(...)`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields


class ConfigError(ValueError):
    """A configuration value is out of its allowed range; the message names it."""


def cache_dir() -> str:
    """Where measurements and built kernels are cached: $DUET_CACHE_DIR, else
    ~/.cache/duetserve (the one read of that variable)."""
    return os.environ.get("DUET_CACHE_DIR") or os.path.expanduser("~/.cache/duetserve")


def check_one_of(name: str, value: object, choices: tuple) -> None:
    """Raises ConfigError naming `name`, the choices and `value` unless value is one of
    `choices`."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}")


# A few-row kernel limit that every step is within (models/kernels.py decides it when the
# low-bit kernels won at every row count measured): `rows <= limit` holds for any step, so
# every reader of the limit (QuantLinear, the decode stack, core/step_time.Layout, the step
# budget, the metrics) keeps its plain comparison.
UNBOUNDED_ROWS = 1 << 30


def describe_row_limit(rows: int) -> str:
    """A few-row limit for logs and labels: "unbounded" for UNBOUNDED_ROWS, else the
    number."""
    return "unbounded" if rows >= UNBOUNDED_ROWS else str(rows)


NORM_PLACEMENTS = ("pre", "sandwich")
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_KINDS = ("full", "sliding")


def attention_pairs(num_new: int, num_computed: int, window: int | None = None) -> int:
    """(query, key) pairs of `num_new` new tokens after `num_computed` cached ones, causal:
    new token j (0-based) attends to num_computed + j + 1 keys, at most `window` of them
    in a sliding-window layer (None: all). The one definition: the cost model
    (metrics/cost_model.py) and the step shape (core/step_time.py) both count with it.

        keys of row j:  min(c + j + 1, W)    rows c+1 .. W-1 grow, the rest hold W
    """
    n, c = num_new, num_computed
    if n <= 0:
        return 0
    if window is None or c + n <= window:
        return n * c + n * (n + 1) // 2
    grow = max(0, window - c - 1)            # rows whose keys are still below W
    return grow * c + grow * (grow + 1) // 2 + (n - grow) * window


@dataclass(frozen=True)
class KVGroup:
    """Layers whose KV lives in the same blocks (core/kv_cache_manager.py keeps one block
    table per group). `window`: None for full attention; W for sliding-window layers,
    which attend to the last W positions (a query at p reads keys p-W+1..p), so their
    blocks that fall out of every future query's window are released."""

    kind: str                        # "full" | "sliding"
    window: int | None
    layer_ids: tuple[int, ...]       # slot s of a block holds layer layer_ids[s]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, as the loader found it. What differs
    between families (Llama, Qwen2/3, Mistral, Mixtral, Gemma 3, Qwen3-MoE) is data here,
    declared per family in models/families/ and read by one model (models/decoder.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style scaling as a tuple of (key, value) pairs so the config stays hashable.
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    has_qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Stored dtype of the weights in the checkpoint (e.g. "q4_1", "bf16"): for byte accounting.
    weight_dtype: str = "f32"
    # --- what differs between families (models/families/) -------------------------------
    # "pre": x + f(norm(x)) (Llama); "sandwich": x + norm'(f(norm(x))) around attention
    # and MLP alike (Gemma: four norms a layer).
    norm_placement: str = "pre"
    qk_norm: bool = False                # RMSNorm over each head of q and k (Qwen3, Gemma 3)
    hidden_act: str = "silu"             # the gated MLP's activation: silu | gelu_tanh
    embedding_scale: float = 1.0         # embeddings are multiplied by it (Gemma: sqrt(d))
    # attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    query_pre_attn_scalar: float | None = None
    # per layer "full" or "sliding" (empty: every layer full); sliding layers attend to the
    # last `sliding_window` positions, with RoPE base `rope_local_theta` (None: rope_theta)
    # and no rope scaling (Gemma 3's local layers)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None   # logits = c * tanh(logits / c)
    # Mixture of experts: layers in moe_layer_ids route each token to num_experts_per_tok
    # of num_experts gated MLPs of moe_intermediate_size (softmax over all experts, top k,
    # renormalised to sum 1 when norm_topk_prob); plus a shared expert of
    # shared_expert_intermediate_size when > 0 (scaled by sigmoid(x . gate) when
    # shared_expert_gate). Other layers have the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layer_ids: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        check_one_of("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        check_one_of("hidden_act", self.hidden_act, HIDDEN_ACTS)
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                                  f"{self.num_hidden_layers} layers")
            for kind in self.layer_types:
                check_one_of("layer type", kind, LAYER_KINDS)
            if "sliding" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ConfigError("sliding layers need sliding_window > 0")
        if self.moe_layer_ids:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok must be in 1..num_experts "
                                  f"({self.num_experts}), got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ConfigError("a mixture-of-experts model needs moe_intermediate_size > 0")
            if not all(0 <= i < self.num_hidden_layers for i in self.moe_layer_ids):
                raise ConfigError(f"moe_layer_ids {self.moe_layer_ids} outside the "
                                  f"{self.num_hidden_layers} layers")

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_kind(self, layer_id: int) -> str:
        return self.layer_types[layer_id] if self.layer_types else "full"

    def layer_window(self, layer_id: int) -> int | None:
        """W for a sliding layer, None for a full one."""
        return self.sliding_window if self.layer_kind(layer_id) == "sliding" else None

    @property
    def num_sliding_layers(self) -> int:
        """Layers that attend over a sliding window (0 for a full-attention model)."""
        return sum(1 for i in range(self.num_hidden_layers) if self.layer_kind(i) == "sliding")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.moe_layer_ids

    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV cache's layer groups (computed here only; the cache manager, the worker
        and the KV transfer read them). Every group has the same number of layer slots, so
        one pool of equal-sized blocks serves them all (as vLLM's hybrid manager does):

            full attention only:  one group of every layer (a block holds all layers)
            full + sliding:       groups of g layers of one kind each; Gemma 3 270M
                                  (3 full, 15 sliding layers): 1 full + 5 sliding groups
                                  of 3, so a long context holds ~W tokens in 5 of them

        The last group of a kind may have fewer layers than slots (padding, unused)."""
        kinds = [self.layer_kind(i) for i in range(self.num_hidden_layers)]
        by_kind = {k: [i for i, x in enumerate(kinds) if x == k] for k in LAYER_KINDS}
        by_kind = {k: v for k, v in by_kind.items() if v}
        if len(by_kind) == 1:
            ((kind, ids),) = by_kind.items()
            return (KVGroup(kind, self.sliding_window if kind == "sliding" else None,
                            tuple(ids)),)
        g = _group_size([len(v) for v in by_kind.values()])
        return tuple(KVGroup(kind, self.sliding_window if kind == "sliding" else None,
                             tuple(ids[a:a + g]))
                     for kind, ids in by_kind.items() for a in range(0, len(ids), g))

    @property
    def kv_layers_per_block(self) -> int:
        """Layer slots of one KV block (all layers for a full-attention model)."""
        return max(len(g.layer_ids) for g in self.kv_groups())

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """KV cache bytes per token of full attention: 2 (K and V) x layers x kv_heads x
        head_dim x bytes (the one definition; the worker sizes blocks with kv_block_bytes,
        the cost model counts traffic with it)."""
        return 2 * self.num_hidden_layers * self.kv_size * bytes_per_element

    def kv_block_bytes(self, block_size: int, bytes_per_element: float) -> float:
        """Bytes of one KV block: block_size tokens of kv_layers_per_block layers."""
        return 2 * self.kv_layers_per_block * self.kv_size * bytes_per_element * block_size


def _group_size(counts: list[int]) -> int:
    """Layers per KV group for kinds with `counts` layers each: the largest size up to the
    smallest count whose padding (unused slots of the last group of a kind) stays within
    1/8 of the layers; else the size with the least padding."""
    total = sum(counts)

    def padding(g: int) -> int:
        return sum(-(-c // g) * g for c in counts) - total
    sizes = range(min(counts), 0, -1)
    return next((g for g in sizes if padding(g) * 8 <= total), min(sizes, key=padding))


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")
LORA_DTYPES = ("auto", "float32", "bfloat16", "int8")
# Quantized KV caches (worker/kv_cache.py, models/kv_quant.py): each (token, KV head) row
# holds its head_dim values packed (int8: one byte each; int4: two a byte) followed by
# float16 scales, one per group of this many values (None: one for the whole head);
# int8 keys are stored Walsh-Hadamard-rotated (kv_quant.rotate_keys).
KV_QUANT_GROUP = {"int8": None, "int4": 32}


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one (token, KV head) row of a quantized KV cache (the one definition:
    the cache's last dimension, its sizing and the transfer layout use it)."""
    group = KV_QUANT_GROUP[kv_dtype] or head_dim
    if head_dim % group or head_dim % 2:
        raise ConfigError(f"--kv-cache-dtype {kv_dtype} needs a head_dim divisible by "
                          f"{group}, got {head_dim}")
    bits = 8 if kv_dtype == "int8" else 4
    return head_dim * bits // 8 + 2 * (head_dim // group)
KQUANT_FORMS = ("measure", "exact", "widened")
PREFILL_ATTENTION = ("auto", "float32", "bfloat16")
SCHEDULING_POLICIES = ("slo", "fcfs")


SPEC_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config '{"method": "ngram", ...}'`, vLLM's keys).

    method: "ngram" (prompt lookup: drafts copied from the request's own tokens) or "draft"
    (a smaller checkpoint sharing the target's tokenizer, `model`). num_speculative_tokens:
    the most drafts verified per request per step (k). adaptive: choose k per step and per
    request from the step's roofline position and the request's measured acceptance (off
    when verifying would be compute-bound); False: always k when drafts exist."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None              # the draft checkpoint (method "draft")
    prompt_lookup_min: int = 2            # shortest n-gram matched (method "ngram")
    prompt_lookup_max: int = 4            # longest n-gram matched, tried first
    adaptive: bool = True
    # like --quantization, for the draft model. int4: a draft only has to agree with the
    # target often, and its cost per token is what bounds the speedup (int4 reads ~0.6 of
    # int8's bytes); accepted tokens are the target's either way.
    quantization: str = "int4"
    # method "draft": the draft proposes only token ids [0, draft_vocab_size) (its LM head
    # reads those rows only; lossless, see spec_decode/draft_model.py). None: all ids.
    # 65,536 of Qwen2.5's 151,936 ids (merge order) cover 98.0% of the tokens of
    # duetserve's own Python and Markdown, and 43% of the head's bytes are read.
    draft_vocab_size: int | None = 65536

    def __post_init__(self) -> None:
        check_one_of("speculative method", self.method, SPEC_METHODS)
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in [1, 16], got "
                              f"{self.num_speculative_tokens}")
        if self.method == "draft" and not self.model:
            raise ConfigError('speculative method "draft" needs "model": the draft '
                              "checkpoint's path")
        if self.method == "ngram" and self.model:
            raise ConfigError('"model" is only used with method "draft"')
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        check_one_of("speculative quantization", self.quantization, QUANTIZATIONS)
        if self.draft_vocab_size is not None and (
                type(self.draft_vocab_size) is not int or self.draft_vocab_size < 1):
            raise ConfigError("draft_vocab_size must be a positive integer or null, got "
                              f"{self.draft_vocab_size!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a dict or a JSON object string (the CLI flag); None
        stays None. Unknown keys and bad JSON raise ConfigError naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative config must be a JSON object")
        if "draft_quantization" in value:      # the key's earlier name
            if "quantization" in value:
                raise ConfigError('give "quantization" (the draft model\'s), not also '
                                  '"draft_quantization"')
            value = {**value}
            value["quantization"] = value.pop("draft_quantization")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative config key(s) {unknown}; known: "
                              f"{sorted(known)}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Engine options. Each field is a CLI flag (`--max-num-seqs`) and a keyword of `LLM()`."""

    model: str | None = None            # None: the default model (SmolLM2-135M-Instruct GGUF)
    tokenizer: str | None = None        # defaults to the model's own tokenizer
    dtype: str = "auto"                 # auto: float32 activations, bf16 GEMMs where fast
    quantization: str = "auto"          # auto: keep the file's low-bit weights low-bit
    kv_cache_dtype: str = "auto"        # auto: the activations' dtype
    device: str = "cpu"
    max_model_len: int | None = None    # None: the checkpoint's context length
    block_size: int = 16
    kv_cache_memory: float = 2.0        # GiB of KV cache
    # Map every page of the KV cache at start (worker/kv_cache.py), as a long-running
    # server's cache ends up: resident memory = the whole cache from the start, and no
    # first-use page faults while serving (180 4 KiB pages a new block on SmolLM2).
    # False: pages are mapped as blocks are first used (an idle engine holds none). A
    # disaggregated instance's shared KV memory (kv_transfer) is left as it is.
    kv_prefault: bool = False
    num_gpu_blocks_override: int | None = None  # exact number of KV blocks (tests)
    # The prefix cache's disk tier (kv_transfer/disk_store.py): full prompt blocks written
    # to this directory in the background, read back by later prompts, across restarts.
    kv_store: str | None = None
    kv_store_max_gib: float = 16.0      # its size cap; least recently used files go first
    # Kernel switches: each changes which kernels run, so each is in the step-time cache
    # key (engine/step_probe.py). Defaults are the fast paths; the others exist to compare
    # and to debug.
    native_kernels: bool = True         # duetserve's C++ kernels (csrc/); False: plain
                                        # torch (process-wide: one compiled module)
    decode_stack: bool = True           # decode-only steps through one native call
                                        # (models/decode_stack.py); False: the modules
    kquant_forms: str = "measure"       # GGUF Q4_K/Q6_K weights: their exact forms, the
                                        # widened int4/int8 ones, or measure which is faster
    huge_pages: bool = True             # weights moved into 2 MiB pages (loader/huge_pages.py)
    amx: bool = True                    # many-row steps of low-bit weights on AMX bf16 tiles
                                        # where the CPU has them and they measured faster than
                                        # the dense path (models/kernels.py); False: dense path
    # Prompt chunks' attention (full-attention layers of a low-bit model): "bfloat16" dot
    # products (the native AVX512-BF16 kernel, or torch's bf16 flash beside AMX), "float32",
    # or "auto": bfloat16 where the CPU has it and it measured faster (models/kernels.py).
    prefill_attention: str = "auto"
    # Batch-invariant results: every step runs the same per-row kernels whatever its rows
    # (low-bit / float32 GEMVs, prompt tokens as decode rows of the paged attention), so a
    # request's tokens do not depend on what shares its steps, on chunking or on the prefix
    # cache (models/kernels.py: make_row_invariant). Needs the native kernels.
    deterministic: bool = False
    # Token budget per step. None: derived from max_step_ms and the step-time model
    # (measured at start-up, engine/step_probe.py, or read from `step_time`), so long
    # prompts are chunked finely enough that running streams keep flowing.
    max_num_batched_tokens: int | None = None
    max_step_ms: float | None = None    # target step time; None: 1.5x a small decode step
    # A step-time model (JSON, as `duet serve --print-config` shows it): the budget and
    # the speculation policy use it as is, nothing is measured; pins the schedule of a run
    # on any machine. None: measured at start-up (cached per machine and switches).
    step_time: str | None = None
    # What the scheduler optimizes (core/slo.py). "slo": goodput, the requests meeting
    # both SLO targets below: steps widened by the running streams' TPOT slack,
    # admission bounded by the TPOT target, waiting order by TTFT deadline. "fcfs": the
    # step-time target alone and arrival order. Both need the derived budget (no
    # --max-num-batched-tokens) to differ; docs/scheduling.md explains the defaults.
    scheduling_policy: str = "slo"
    slo_ttft_ms: float = 2000.0         # time to first token: the interactive limit
    slo_tpot_ms: float = 100.0          # time per output token: ahead of fast reading
    max_num_seqs: int = 128
    max_n: int = 128                    # cap on samples per request (OpenAI's limit)
    max_waiting_requests: int = 1024    # refuse new requests past this many waiting (0: no cap)
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    seed: int = 0
    trace_file: str | None = None       # Chrome/Perfetto trace of steps and requests
    # Debug: run the scheduler's and block pool's check_integrity() each time the engine
    # goes idle.
    check_integrity_when_idle: bool = False
    # Speculative decoding: a SpeculativeConfig, or its dict / JSON form (parsed once here).
    speculative_config: SpeculativeConfig | dict | str | None = None
    # LoRA adapters (PEFT folders) a server offers by name, as "name=PATH" strings or
    # (name, path) pairs (normalised to pairs); requests may also name others (offline
    # LoRARequest, runtime loading). max_loras: adapters resident at once (the running
    # requests use at most this many distinct ones); max_lora_rank: the largest rank;
    # lora_dtype: the adapters' weights in memory; auto: int8 on a low-bit base (the QLoRA
    # case: a quarter of float32's bytes, each step streams every adapter of its rows; its
    # rounding, which grows with the adapter's size, is far below such a base's own error),
    # else the base's dtype.
    lora_modules: tuple = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        # NOTE: normalised at construction (the dataclass is frozen afterwards).
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        check_one_of("dtype", self.dtype, DTYPES)
        check_one_of("quantization", self.quantization, QUANTIZATIONS)
        check_one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_one_of("kquant_forms", self.kquant_forms, KQUANT_FORMS)
        check_one_of("prefill_attention", self.prefill_attention, PREFILL_ATTENTION)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two > 0, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not self.kv_store_max_gib > 0:
            raise ConfigError(f"kv_store_max_gib must be > 0, got {self.kv_store_max_gib}")
        if self.kv_store is not None and not self.enable_prefix_caching:
            raise ConfigError("kv_store is the prefix cache's disk tier: it needs prefix "
                              "caching (drop --no-enable-prefix-caching)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ConfigError(f"max_step_ms must be > 0, got {self.max_step_ms}")
        if self.max_n < 1:
            raise ConfigError(f"max_n must be >= 1, got {self.max_n}")
        check_one_of("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ConfigError(f"{name} must be a number of ms > 0, got {value!r}")
        if self.max_waiting_requests < 0:
            raise ConfigError(
                f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.deterministic and not self.native_kernels:
            raise ConfigError("deterministic needs the native kernels (its per-row kernels "
                              "are duetserve's C++ ones); drop --no-native-kernels")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules))
        check_one_of("lora_dtype", self.lora_dtype, LORA_DTYPES)
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(f"max_loras and max_lora_rank must be >= 1, got "
                              f"{self.max_loras} and {self.max_lora_rank}")

    def kernel_switches(self) -> dict[str, object]:
        """The options that change which kernels a step runs (the step-time cache key)."""
        return {k: getattr(self, k) for k in (
            "dtype", "quantization", "kv_cache_dtype", "native_kernels", "decode_stack",
            "kquant_forms", "huge_pages", "kv_prefault", "deterministic", "amx",
            "prefill_attention")}

    def load_options(self) -> dict[str, object]:
        """The kernel switches as load_model's keywords (loader/__init__.py)."""
        return {"native": self.native_kernels, "decode_stack": self.decode_stack,
                "kquant_forms": self.kquant_forms, "huge_pages": self.huge_pages,
                "deterministic": self.deterministic, "amx": self.amx,
                "prefill_attention": self.prefill_attention}

    def to_json(self) -> dict:
        """Every field (the speculative config as a dict): `--print-config`."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.speculative_config is not None:
            d["speculative_config"] = asdict(self.speculative_config)
        return d

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        """Build from keyword arguments, naming any unknown option."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


def parse_lora_modules(modules) -> tuple[tuple[str, str], ...]:
    """--lora-modules as (name, path) pairs: each item "name=PATH" or a pair; names unique.
    Raises ConfigError naming the bad item."""
    out: list[tuple[str, str]] = []
    for item in modules or ():
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            pair = (name.strip(), path.strip()) if sep else ("", "")
        else:
            pair = tuple(item) if isinstance(item, (list, tuple)) and len(item) == 2 \
                else ("", "")
        if not all(isinstance(v, str) and v for v in pair):
            raise ConfigError(f"lora_modules: expected name=PATH, got {item!r}")
        if pair[0] in {n for n, _ in out}:
            raise ConfigError(f"lora_modules: the name {pair[0]!r} is given twice")
        out.append(pair)
    return tuple(out)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs; derived from EngineConfig once the model is known."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    # Never schedule more than this many tokens for one request's prefill chunk (0 = budget).
    long_prefill_token_threshold: int = 0
    # Per-step budget from the measured step cost (core/step_budget.StepBudget); None: the
    # fixed max_num_batched_tokens (then also the largest budget any step gets).
    step_budget: object | None = None
    # Refuse new requests while this many wait (0 = unbounded); preempted ones always fit.
    max_num_waiting: int = 0
    # Speculative decoding (core/spec_policy.SpecPolicy): how many drafts each request
    # verifies per step; None: no speculation.
    spec_policy: object | None = None
    # The sliding window of each KV group (ModelConfig.kv_groups; None: full attention):
    # the KV cache manager keeps one block table per group.
    kv_windows: tuple[int | None, ...] = (None,)
    # Goodput-first scheduling (core/slo.SloPolicy: SLO targets, slack-widened budgets,
    # TPOT-bounded admission, TTFT-deadline order); None: StepBudget's budget, FCFS.
    slo: object | None = None
    # The running requests use at most this many distinct LoRA adapters (the worker's
    # resident slots); a waiting request whose adapter would exceed it waits (0: no cap).
    max_loras: int = 0
