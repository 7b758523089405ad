"""The one model of how long an engine step takes (pure Python, no torch).

The scheduler's step budget (core/step_budget.py), the speculation policy
(core/spec_policy.py) and the simulator (sim/) all price a step the same way:

    shape   = StepShape.of_slices(so.slices(), layout)     what the scheduler decided
    seconds = step_time.seconds(shape)                     StepTime: measured, linear

`Layout` is how the engine lays a step out, which decides the kernels each part runs:

    rows  <= few_rows, decode rows only    "few"    low-bit / float32 GEMVs; the native
                                                     decode stack (one C++ call a step)
    rows  <= few_rows, some prefill slice  "mixed"  the same GEMVs through the per-layer
                                                     modules (the stack takes decode rows only)
    rows  >  few_rows                      "many"   dense GEMMs (bf16 or fp32), a cliff
    (few_rows = UNBOUNDED_ROWS: the low-bit kernels run every step, no step is "many")

    a slice of n new tokens after c cached ones is laid out as
      n == 1 (decode) or n <= chunk_rows   decode rows: row j reads c + j + 1 KV entries
                                           through the paged decode kernel
      c == 0                               a fresh prefill: flash attention over the
                                           causal half, n(n+1)/2 (query, key) pairs
      n * (c + n) <= masked_max_scores     a chunk after context: one masked score matrix
                                           of n * (c + n) entries (several times slower
                                           per entry than flash)
      otherwise                            two flash calls (chunk over its context, then
                                           over itself), n*c + n(n+1)/2 pairs

`StepTime.seconds(shape)` is a sum of coefficient x term (TERMS, explained at TERMS).
Every coefficient is measured on this machine (engine/step_probe.py fits them to probe
steps through the real runner, `fit_step_time` in core/step_fit.py); pricing a shape is
a dozen multiplications, so a scheduler can price many candidate steps per schedule().

`StepPricer` is the interface: StepTime (this CPU, measured) and sim/gpu.py's
RooflineStepTime (a GPU from the hardware table) both implement it.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

from duetserve.config import UNBOUNDED_ROWS, attention_pairs

SCHEMA = "duet-step-time/1"

# The terms of the model, in coefficient order. Each coefficient is seconds per unit.
TERMS = (
    "few_step",     # 1 on a few-row step of decode rows only: its fixed cost (Python,
                    # sampler set-up; the native decode stack's one call when it runs)
    "few_row",      # rows of such a step: weight bytes shared, per-row activations
    "mixed_step",   # 1 on a few-row step with a prefill slice: the per-layer modules'
                    # dispatch (a dozen torch ops per layer) instead of the stack's call
    "mixed_row",    # rows of such a step
    "many_step",    # 1 on a step of more than few_rows rows: dense GEMMs (and, without a
                    # resident dense copy, the weights dequantized for the call)
    "many_row",     # rows of such a step: GEMM FLOPs
    "logit",        # rows that are sampled: the LM head's row, the sampler's row
    "request",      # scheduled requests: per-request work in the runner and sampler
    "decode_kv",    # KV entries decode rows read from memory: each decode-row slice's
                    # context once, c + n (paged decode attention: bytes)
    "decode_kv_reread",  # the same slice's entries read again by its later rows: a chunk
                    # laid out as n decode rows reads its context n times, the repeats
                    # from cache (SmolLM2 on a Zen 5: 0.45-0.8 us/entry, the first read
                    # 1.6-2.0)
    "fresh_pair",   # (query, key) pairs of fresh prefills (flash, causal half)
    "chunk_score",  # score entries of chunks after context run as one masked matrix
    "chunk_pair",   # (query, key) pairs of longer chunks after context (flash, twice)
    "cold_step",    # 1 on a cold step: the first after the engine went idle, which gave
                    # its freed heap back to the OS (EngineCore._on_idle), so the step
                    # faults its transient buffers in again
    "cold_row",     # rows of a cold step (the transients grow with the rows)
)
_T = {name: i for i, name in enumerate(TERMS)}
PATHS = ("few", "mixed", "many")


@dataclass(frozen=True)
class Layout:
    """How the engine lays out a step (see the module docstring); numbers the runner and
    the model report at start-up (engine/step_probe.layout_of)."""

    few_rows: int = 0            # steps of up to this many rows run the few-row kernels
                                 # (UNBOUNDED_ROWS: every step does)
    chunk_rows: int = 0          # chunks of up to this many tokens run as decode rows
    masked_max_scores: int = 0   # chunks after context with at most this many score
                                 # entries n*(c+n) run one masked matrix (0: none do)
    # The window W of the model's sliding-window layers, for a pricer that prices those
    # layers apart (sim/gpu.RooflineStepTime): the shape then also counts keys capped at
    # W (the window_* sums). 0: none counted (no sliding layers, or a pricer whose terms
    # cover every layer alike, as the measured StepTime's do).
    window: int = 0

    @property
    def is_unbounded(self) -> bool:
        """Every step runs the few-row kernels (none takes the "many" path)."""
        return self.few_rows >= UNBOUNDED_ROWS

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Layout":
        return cls(int(d.get("few_rows", 0)), int(d.get("chunk_rows", 0)),
                   int(d.get("masked_max_scores", 0)), int(d.get("window", 0)))


@dataclass(slots=True)
class StepShape:
    """The sums of one step that its time depends on. Build it with `add` per slice (or
    `of_slices`); `cold` is set by whoever knows the engine was idle before the step."""

    layout: Layout
    num_reqs: int = 0
    num_rows: int = 0            # tokens through the linear layers
    num_logits: int = 0          # rows that are sampled
    num_decode_rows: int = 0     # rows laid out as decode rows
    num_prefills: int = 0        # slices laid out as prefills (not as decode rows)
    decode_kv: int = 0           # KV entries read by decode rows
    decode_kv_reread: int = 0    # of those, read again by a later row of the same slice
    prefill_context: int = 0     # cached positions read by prefill slices (sum of c)
    fresh_pairs: int = 0
    chunk_scores: int = 0
    chunk_pairs: int = 0
    cold: bool = False
    # with layout.window = W > 0, the same sums with every row's keys capped at W (what a
    # sliding-window layer reads): decode rows' KV entries, prefill slices' (query, key)
    # pairs, and prefill slices' cached positions read (sum of min(c, W - 1): the first
    # new token's window less itself)
    window_decode_kv: int = 0
    window_pairs: int = 0
    window_context: int = 0

    def add(self, num_new: int, num_computed: int, num_logits: int) -> None:
        """Count one request's slice: `num_new` tokens after `num_computed` cached ones,
        `num_logits` of its rows sampled. Mutates self."""
        if num_new <= 0:
            return
        lay = self.layout
        self.num_reqs += 1
        self.num_rows += num_new
        self.num_logits += num_logits
        n, c, w = num_new, num_computed, lay.window
        if n == 1 or n <= lay.chunk_rows:
            self.num_decode_rows += n
            pairs = attention_pairs(n, c)
            self.decode_kv += pairs
            self.decode_kv_reread += pairs - (c + n)
            if w:
                self.window_decode_kv += attention_pairs(n, c, w)
            return
        self.num_prefills += 1
        self.prefill_context += c
        pairs = attention_pairs(n, c)
        if w:
            self.window_pairs += attention_pairs(n, c, w)
            self.window_context += min(c, w - 1)
        if c == 0:
            self.fresh_pairs += pairs
        elif n * (c + n) <= lay.masked_max_scores:
            self.chunk_scores += n * (c + n)
        else:
            self.chunk_pairs += pairs

    @property
    def path(self) -> str:
        """"few", "mixed" or "many": the linear kernels the step runs (module docstring)."""
        if self.num_rows > self.layout.few_rows:
            return "many"
        return "mixed" if self.num_prefills else "few"

    @classmethod
    def of_slices(cls, slices: Iterable, layout: Layout, cold: bool = False) -> "StepShape":
        """The shape of scheduled slices (outputs.ScheduledSlice: SchedulerOutput.slices()
        or StepStats.items)."""
        shape = cls(layout, cold=cold)
        for s in slices:
            shape.add(s.num_new_tokens, s.num_computed_before, s.num_logits)
        return shape

    @classmethod
    def of(cls, items: Iterable[tuple[int, int, int]], layout: Layout,
           cold: bool = False) -> "StepShape":
        """The shape of (num_new, num_computed, num_logits) per slice."""
        shape = cls(layout, cold=cold)
        for n, c, logits in items:
            shape.add(n, c, int(logits))
        return shape

    @classmethod
    def decode_rows(cls, layout: Layout, num_reqs: int, num_rows: int, context: int
                    ) -> "StepShape":
        """A step of decode rows only, every one sampled: `num_reqs` requests with
        `num_rows` rows in all (a verify slice is k+1 rows of one request), each row
        after about `context` cached tokens (a request's rows past its first re-read it)."""
        return cls(layout, num_reqs=num_reqs, num_rows=num_rows, num_logits=num_rows,
                   num_decode_rows=num_rows, decode_kv=num_rows * (context + 1),
                   decode_kv_reread=(num_rows - num_reqs) * (context + 1),
                   window_decode_kv=(num_rows * min(context + 1, layout.window)
                                     if layout.window else 0))

    def features(self) -> list[float]:
        """The value of each of TERMS for this shape (core/step_fit.py fits on them)."""
        f = [0.0] * len(TERMS)
        rows = self.num_rows
        path = self.path
        f[_T[f"{path}_step"]] = 1.0 if rows else 0.0
        f[_T[f"{path}_row"]] = float(rows)
        f[_T["logit"]] = float(self.num_logits)
        f[_T["request"]] = float(self.num_reqs)
        f[_T["decode_kv"]] = float(self.decode_kv - self.decode_kv_reread)
        f[_T["decode_kv_reread"]] = float(self.decode_kv_reread)
        f[_T["fresh_pair"]] = float(self.fresh_pairs)
        f[_T["chunk_score"]] = float(self.chunk_scores)
        f[_T["chunk_pair"]] = float(self.chunk_pairs)
        if self.cold and rows:
            f[_T["cold_step"]] = 1.0
            f[_T["cold_row"]] = float(rows)
        return f


class StepPricer(Protocol):
    """Anything that prices a step: StepTime (measured on this CPU), sim/gpu.py's
    RooflineStepTime (a GPU from the hardware table)."""

    layout: Layout

    def seconds(self, shape: StepShape) -> float: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class StepTime:
    """seconds(shape) = sum over TERMS of coef x the shape's term (TERMS says what each
    term is and why it costs). Frozen: a measurement is never edited, only replaced."""

    layout: Layout
    coef: tuple[float, ...]      # seconds per unit, in TERMS order

    def __post_init__(self) -> None:
        if len(self.coef) != len(TERMS):
            raise ValueError(f"a step time has {len(TERMS)} coefficients ({TERMS}), got "
                             f"{len(self.coef)}")

    @classmethod
    def of(cls, layout: Layout, **coef_s: float) -> "StepTime":
        """From named coefficients (seconds); the others are 0. ValueError on an unknown
        name."""
        unknown = set(coef_s) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown step-time terms {sorted(unknown)}; known: {TERMS}")
        return cls(layout, tuple(float(coef_s.get(t, 0.0)) for t in TERMS))

    def term(self, name: str) -> float:
        """One coefficient (seconds per unit) by its TERMS name."""
        return self.coef[_T[name]]

    def seconds(self, s: StepShape) -> float:
        """The step's modelled duration in seconds (0 for a step without rows). Pure."""
        rows = s.num_rows
        if not rows:
            return 0.0
        c = self.coef
        if rows > self.layout.few_rows:
            t = c[4] + c[5] * rows
        elif s.num_prefills:
            t = c[2] + c[3] * rows
        else:
            t = c[0] + c[1] * rows
        t += (c[6] * s.num_logits + c[7] * s.num_reqs
              + c[8] * (s.decode_kv - s.decode_kv_reread) + c[9] * s.decode_kv_reread
              + c[10] * s.fresh_pairs + c[11] * s.chunk_scores + c[12] * s.chunk_pairs)
        if s.cold:
            t += c[13] + c[14] * rows
        return t

    def row_seconds(self, path: str) -> float:
        """The cost of one more row on `path` ("few", "mixed", "many"), logits aside."""
        return self.coef[_T[f"{path}_row"]]

    def scaled(self, factor: float) -> "StepTime":
        """Every coefficient times `factor` > 0 (a machine 1/factor as fast)."""
        if not factor > 0:
            raise ValueError(f"scale factor must be > 0, got {factor}")
        return StepTime(self.layout, tuple(x * factor for x in self.coef))

    def is_plausible(self) -> bool:
        """A larger step must cost more: a model whose rows are free on the path most
        steps take (few and many rows; few and mixed when the few-row kernels run every
        step; few alone when every chunk is laid out as decode rows too, as deterministic
        mode does: no step is mixed) was measured on a machine too noisy to tell; it is
        neither used nor cached."""
        lay = self.layout
        paths = ("few",) if lay.is_unbounded and lay.chunk_rows >= UNBOUNDED_ROWS else \
            ("few", "mixed") if lay.is_unbounded else \
            ("few", "many") if lay.few_rows else ("many",)
        return all(self.row_seconds(p) + self.term("logit") > 1e-7 for p in paths)

    def describe(self) -> str:
        """One line for logs and reports: the layout and every non-zero coefficient."""
        lay = self.layout
        units = {"step": "ms", "row": "ms/row", "logit": "ms/row", "request": "ms/request",
                 "kv": "us/entry", "reread": "us/entry", "pair": "ns/pair",
                 "score": "ns/entry"}
        parts = []
        for name, x in zip(TERMS, self.coef):
            if not x:
                continue
            unit = units[name.rsplit("_", 1)[-1]] if "_" in name else units[name]
            scale = {"ms": 1e3, "ms/row": 1e3, "ms/request": 1e3, "us/entry": 1e6,
                     "ns/pair": 1e9, "ns/entry": 1e9}[unit]
            parts.append(f"{name} {x * scale:.3g} {unit}")
        few = "at every step size" if lay.is_unbounded else \
            f"up to {lay.few_rows} rows"
        rows = "every chunk" if lay.chunk_rows >= UNBOUNDED_ROWS else \
            f"chunks of up to {lay.chunk_rows} tokens"
        return (f"few-row kernels {few}, {rows} as decode rows, masked chunk attention up to "
                f"{lay.masked_max_scores} entries; " + ", ".join(parts))

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "layout": self.layout.to_json(),
                "coef_s": dict(zip(TERMS, self.coef))}

    @classmethod
    def from_json(cls, d: dict) -> "StepTime":
        """ValueError (naming what is wrong) on anything but to_json's output."""
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise ValueError(f"not a step-time model (schema "
                             f"{d.get('schema') if isinstance(d, dict) else None!r}, "
                             f"expected {SCHEMA!r})")
        coef = d.get("coef_s")
        if not isinstance(coef, dict):
            raise ValueError("a step-time model needs coef_s: {term: seconds}")
        coef = dict(coef)
        if "decode_kv_reread" not in coef:       # a model from before the term: every
            coef["decode_kv_reread"] = coef.get("decode_kv", 0.0)  # read priced alike
        try:
            return cls.of(Layout.from_json(d.get("layout", {})),
                          **{k: float(v) for k, v in coef.items()})
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad step-time model: {e}") from None
