"""Prometheus exporter for the server: vLLM's metric names and buckets, `duet:` prefix.

Fed on the engine thread from two sources:
  * `observe_step(StepStats)`   every engine step (gauges, cumulative counters, step sizes)
  * `observe_finished(out, reason)`  once per request (latency histograms from
    RequestOutput.metrics, token counts, request_success_total{finished_reason}, and
    goodput_requests_total{slo, outcome}: against the server's SLO targets, whether the
    request met its TTFT target, its TPOT target and both)
Each app owns its CollectorRegistry, so several servers can live in one process (tests).
A one-line throughput log (prefill / decode tokens/s) is written at most every
`log_interval` seconds while steps run.
"""
from __future__ import annotations

import logging
import threading
import time

import prometheus_client
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from duetserve.config import EngineConfig, describe_row_limit
from duetserve.metrics.step_accounting import StepAccount
from duetserve.outputs import RequestOutput, SpecDecodeStats, StepStats

log = logging.getLogger("duetserve.metrics")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
STEP_DURATION_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
                         1.28, 2.56, 5.12, 10.24]
CONTENT_TYPE = CONTENT_TYPE_LATEST


def buckets_1_2_5(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, max_num_batched_tokens: int,
                 log_interval: float = 10.0,
                 slo_s: tuple[float, float] | None = None) -> None:
        """`slo_s`: the server's (TTFT, TPOT) targets in seconds that the goodput
        counters judge ended requests by; None: EngineConfig's defaults."""
        prometheus_client.disable_created_metrics()   # no `*_created` series (as vLLM)
        self.registry = CollectorRegistry(auto_describe=True)
        r, lbl = self.registry, ["model_name"]
        self._model = model_name

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"duet:{name}", doc, lbl, buckets=buckets,
                             registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"duet:{name}", doc, lbl, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"duet:{name}", doc, lbl, registry=r).labels(model_name)

        tokens = buckets_1_2_5(max_model_len)
        step_tokens = buckets_1_2_5(max_num_batched_tokens)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.first_chunk = hist(
            "time_to_first_chunk_seconds", "Streamed requests: time from the HTTP request's "
            "arrival to its first chunk handed to the HTTP server (what a client times as "
            "TTFT, less the network and its own parsing).", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token.",
                         TPOT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Latency between tokens.",
                        TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time waiting before first scheduled.",
                          REQUEST_LATENCY_BUCKETS)
        self.req_prompt = hist("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.req_gen = hist("request_generation_tokens", "Generated tokens per request.",
                            tokens)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of ended requests.")
        self.gen_tokens = counter("generation_tokens", "Generated tokens of ended requests.")
        self._success = Counter("duet:request_success", "Ended requests by finish reason.",
                                lbl + ["finished_reason"], registry=r)
        self._goodput = Counter(
            "duet:goodput_requests", "Requests that ended with output (stop or length; "
            "errors count as missed, aborts not at all), by SLO (ttft, tpot, both) and "
            "outcome (met, missed) against the server's targets "
            "(duet:goodput_slo_seconds); goodput = rate of slo=both, outcome=met.",
            lbl + ["slo", "outcome"], registry=r)
        slo_gauge = Gauge("duet:goodput_slo_seconds", "The SLO targets the goodput "
                          "counters use (--slo-ttft-ms, --slo-tpot-ms).", lbl + ["slo"],
                          registry=r)
        if slo_s is None:
            defaults = EngineConfig()
            slo_s = (defaults.slo_ttft_ms / 1e3, defaults.slo_tpot_ms / 1e3)
        self.slo_s = slo_s
        for name, value in zip(("ttft", "tpot"), slo_s):
            slo_gauge.labels(model_name, name).set(value)
            for outcome in ("met", "missed"):        # every series from the start
                self._goodput.labels(model_name, name, outcome)
        for outcome in ("met", "missed"):
            self._goodput.labels(model_name, "both", outcome)
        self.running = gauge("num_requests_running", "Requests running.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage (1 = full).")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "KV blocks in use.")
        self._kv_kind = Gauge("duet:kv_cache_kind_used_blocks", "KV blocks in use per "
                              "attention kind (full, sliding).", lbl + ["kind"], registry=r)
        self.preemptions = counter("num_preemptions", "Preemptions.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries (tokens).")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits in memory "
                                   "(tokens).")
        self.prefix_disk_hits = counter("prefix_cache_disk_hits", "Prefix cache hits "
                                        "loaded from the disk tier, --kv-store (tokens).")
        self._hit_bytes = Counter("duet:prefix_cache_hit_bytes", "Bytes of KV the prefix "
                                  "cache's hits saved computing, per tier (memory, disk).",
                                  lbl + ["tier"], registry=r)
        self._capacity = Gauge("duet:kv_cache_capacity_tokens", "Tokens of KV that fit in "
                               "the cache (its dtype as a label).", lbl + ["kv_cache_dtype"],
                               registry=r)
        self._kv_bytes_per_token = 0
        self.step_prefill = hist("step_prefill_tokens", "Prefill tokens per step.",
                                 step_tokens)
        self.step_decode = hist("step_decode_tokens", "Decode tokens per step.", step_tokens)
        self.step_duration = hist("step_duration_seconds", "Engine step duration.",
                                  STEP_DURATION_BUCKETS)
        # Latest step's model FLOPs / bytes utilisation, by phase (prefill, decode, mixed).
        self.step_mfu = Gauge("duet:step_mfu", "MFU of the latest step of each phase "
                              "(cost-model FLOPs / step time / peak FLOP/s).",
                              ["model_name", "phase"], registry=self.registry)
        self.step_mbu = Gauge("duet:step_mbu", "MBU of the latest step of each phase "
                              "(cost-model bytes / step time / memory bandwidth).",
                              ["model_name", "phase"], registry=self.registry)
        self.kernel_info = Gauge("duet:kernel_info", "Weight forms and kernel choice of the "
                                 "loaded model (value 1; the labels say what and why).",
                                 ["model_name", "weights", "dense_dtype", "lowbit_max_rows",
                                  "reason"], registry=self.registry)
        self.steps_by_kernel = Counter("duet:steps_by_kernel", "Engine steps by the linear "
                                       "kernel their row count selects (lowbit: GEMV-style "
                                       "low-bit; dense: GEMM).", ["model_name", "kernel"],
                                       registry=self.registry)
        # Speculative decoding (vLLM's names): verify slices, drafts verified, drafts
        # accepted, and accepted drafts by their position in the slice.
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verify slices "
                                   "(request-steps with at least one draft).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter(
            "duet:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
            "their position in the verify slice (0 = first draft).",
            ["model_name", "position"], registry=self.registry)
        self._last_spec = (0, 0, 0, ())
        self._lowbit_max_rows = -1       # no quantized linears: every step is dense
        # NOTE: cumulative engine counters arrive as totals; Prometheus counters take deltas.
        self._last_totals = (0, 0, 0, 0)
        self._lock = threading.Lock()
        self._log_interval = log_interval
        self._window = [time.monotonic(), 0, 0, 0]     # start, prefill, decode, steps

    # -- engine-thread feeds ----------------------------------------------------------
    def set_kernel_info(self, weights: str, dense_dtype: str, lowbit_max_rows: int,
                        reason: str) -> None:
        """Once at start-up: what `LoadedModel.describe()` logs, as labels (the row limit
        "unbounded" when the low-bit kernels run every step)."""
        self._lowbit_max_rows = lowbit_max_rows
        self.kernel_info.labels(self._model, weights, dense_dtype,
                                describe_row_limit(lowbit_max_rows), reason).set(1)

    def set_kv_cache_info(self, kv_dtype: str, capacity_tokens: int,
                          bytes_per_token: int) -> None:
        """Once at start-up: the KV cache's capacity in tokens and its bytes per token
        (which turn the prefix-cache hits into bytes)."""
        self._capacity.labels(self._model, kv_dtype).set(capacity_tokens)
        self._kv_bytes_per_token = bytes_per_token

    def observe_step(self, st: StepStats) -> None:
        with self._lock:
            self._set_state(st)
            if st.num_tokens == 0 and st.step_seconds == 0.0:
                return          # an idle refresh, not a step
            self.step_prefill.observe(st.num_prefill_tokens)
            self.step_decode.observe(st.num_decode_tokens)
            self.step_duration.observe(st.step_seconds)
            rows = st.num_prefill_tokens + st.num_decode_tokens
            self.steps_by_kernel.labels(
                self._model, "lowbit" if rows <= self._lowbit_max_rows else "dense").inc()
            account = st.account
            if isinstance(account, StepAccount):
                self.step_mfu.labels(self._model, account.phase).set(account.mfu)
                self.step_mbu.labels(self._model, account.phase).set(account.mbu)
            self._window[1] += st.num_prefill_tokens
            self._window[2] += st.num_decode_tokens
            self._window[3] += 1
            self._maybe_log(st)

    def _set_state(self, st: StepStats) -> None:
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_usage.set(st.kv_usage)
        self.kv_used_blocks.set(st.num_used_blocks)
        for kind, n in st.used_blocks_by_kind.items():
            self._kv_kind.labels(self._model, kind).set(n)
        totals = (st.num_preemptions, st.prefix_cache_queries, st.prefix_cache_hits,
                  st.prefix_cache_disk_hits)
        hit_bytes = (None, None, self._hit_bytes.labels(self._model, "memory"),
                     self._hit_bytes.labels(self._model, "disk"))
        for c, b, new, old in zip((self.preemptions, self.prefix_queries, self.prefix_hits,
                                   self.prefix_disk_hits), hit_bytes, totals,
                                  self._last_totals):
            if new > old:
                c.inc(new - old)
                if b is not None:
                    b.inc((new - old) * self._kv_bytes_per_token)
        self._last_totals = totals
        if st.spec is not None:
            self._set_spec(st.spec)

    def _set_spec(self, spec: SpecDecodeStats) -> None:
        """Cumulative SpecDecodeStats -> counter increments."""
        per_pos = tuple(spec.accepted_per_pos)
        new = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        for c, n, o in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted),
                           new, self._last_spec[:3]):
            if n > o:
                c.inc(n - o)
        old_pos = self._last_spec[3]
        for j, n in enumerate(per_pos):
            o = old_pos[j] if j < len(old_pos) else 0
            if n > o or j >= len(old_pos):
                self.spec_accepted_per_pos.labels(self._model, str(j)).inc(max(n - o, 0))
        self._last_spec = (*new, per_pos)

    def _maybe_log(self, st: StepStats) -> None:
        now = time.monotonic()
        start, prefill, decode, steps = self._window
        if now - start < self._log_interval:
            return
        dt = now - start
        log.info("throughput: prefill %.1f tok/s, decode %.1f tok/s (%d steps in %.1f s); "
                 "running %d, waiting %d, KV cache %.1f%%", prefill / dt, decode / dt, steps,
                 dt, st.num_running, st.num_waiting, 100.0 * st.kv_usage)
        self._window = [now, 0, 0, 0]

    def observe_first_chunk(self, seconds: float) -> None:
        """A streamed request's first chunk went to the HTTP server `seconds` after its
        arrival (called on the event loop)."""
        with self._lock:
            self.first_chunk.observe(seconds)

    def observe_finished(self, out: RequestOutput | None, reason: str) -> None:
        with self._lock:
            self._success.labels(self._model, reason).inc()
            self._count_goodput(out, reason)
            if out is None:
                return
            m = out.metrics
            # `out` is the request's last delta: the count comes from its metrics.
            num_gen = m.num_generation_tokens if m is not None else 0
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.gen_tokens.inc(num_gen)
            self.req_prompt.observe(len(out.prompt_token_ids))
            self.req_gen.observe(num_gen)
            if m is None:
                return
            for hist, value in ((self.queue, m.queue_time), (self.ttft, m.ttft),
                                (self.tpot, m.tpot), (self.e2e, m.e2e_latency)):
                if value is not None:
                    hist.observe(value)
            for value in m.inter_token_latencies:
                self.itl.observe(value)

    def _count_goodput(self, out: RequestOutput | None, reason: str) -> None:
        """One ended request into goodput_requests_total (class docstring): TTFT met when
        its TTFT is within the target, TPOT met when its mean TPOT is (or it has fewer
        than two tokens, as `duet bench serve` counts it). Caller holds the lock."""
        if reason == "abort":
            return
        m = None if out is None else out.metrics
        ok = reason in ("stop", "length") and m is not None and m.ttft is not None
        ttft_ok = ok and m.ttft <= self.slo_s[0]
        tpot_ok = ok and (m.tpot is None or m.tpot <= self.slo_s[1])
        for name, met in (("ttft", ttft_ok), ("tpot", tpot_ok), ("both", ttft_ok and tpot_ok)):
            self._goodput.labels(self._model, name, "met" if met else "missed").inc()

    # -- exposition -----------------------------------------------------------------------
    def render(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)
