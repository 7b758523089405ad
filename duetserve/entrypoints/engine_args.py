"""Engine flags shared by every command that runs the engine (generate, chat, serve,
bench throughput). Each flag is an EngineConfig field; `--no-prefix-caching` is the
negation of enable_prefix_caching."""
from __future__ import annotations

import argparse
import logging

from duetserve.config import (DTYPES, KQUANT_FORMS, KV_CACHE_DTYPES, LORA_DTYPES,
                              PREFILL_ATTENTION, QUANTIZATIONS, SCHEDULING_POLICIES,
                              ConfigError, EngineConfig)
from duetserve.entrypoints.cli import UserError
from duetserve.outputs import OutputAccumulator


def add_engine_arguments(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """Every EngineConfig flag, in groups. Mutates `p`."""
    if positional_model:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None,
                   help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    g = p.add_argument_group("engine")
    _add_model_arguments(g)
    _add_scheduler_arguments(g)
    _add_kernel_switches(p.add_argument_group(
        "kernel switches (defaults: the fast paths; to compare or debug)"))
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--seed", type=int, default=EngineConfig().seed)
    g.add_argument("--trace-file", default=None,
                   help="write a Chrome/Perfetto trace (steps, requests, MFU/MBU) here")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 3}\' or \'{"method": "draft", "model": '
                        'PATH}\'; keys: method, num_speculative_tokens, model, '
                        'prompt_lookup_min, prompt_lookup_max, adaptive (default true), '
                        'quantization (the draft model\'s, default int4), '
                        'draft_vocab_size (the draft proposes ids below it, default 65536; '
                        'null: all; docs/speculative_decoding.md)')
    _add_lora_arguments(p.add_argument_group("LoRA adapters"))
    g.add_argument("-v", "--verbose", action="store_true", help="log engine details")


def _add_lora_arguments(g: argparse._ArgumentGroup) -> None:
    d = EngineConfig()
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served by name: a request's `model` "
                        "selects one (GET /v1/models lists them)")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="LoRA adapters resident at once; the running requests use at most "
                        "this many distinct ones (default %(default)s)")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="the largest LoRA rank accepted (default %(default)s)")
    g.add_argument("--lora-dtype", choices=LORA_DTYPES, default=d.lora_dtype,
                   help="LoRA weights in memory: int8 (a float32 scale per row) reads a "
                        "quarter of float32's bytes a step, bfloat16 half; auto: the base's "
                        "dtype (default %(default)s)")


def _add_model_arguments(g: argparse._ArgumentGroup) -> None:
    """Weights, context and KV cache."""
    d = EngineConfig()
    g.add_argument("--dtype", default=d.dtype, choices=list(DTYPES),
                   help="auto (default): float32 activations, many-row GEMMs in bfloat16 "
                        "where this CPU runs bf16 fast (measured once); or force one dtype")
    g.add_argument("--quantization", default=d.quantization, choices=list(QUANTIZATIONS),
                   help="auto (default): keep the file's low-bit weights low-bit (GGUF "
                        "Q4_x -> int4, other quantized types -> int8); none: dequantize "
                        "to --dtype; int8/int4: pack every linear weight so")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context limit in tokens (default: the checkpoint's)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cache dtype; bfloat16 halves the bytes long-context decode "
                        "reads (math stays float32). auto: the activations' dtype")
    g.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory,
                   help="GiB of KV cache (default %(default)s)")
    g.add_argument("--kv-prefault", action="store_true",
                   help="map every KV cache page at start (resident memory = the whole "
                        "cache at once) so that serving never pays first-use page faults "
                        "of new blocks; default: map pages as blocks are first used")
    g.add_argument("--kv-store", default=d.kv_store, metavar="DIR",
                   help="disk tier of the prefix cache: full prompt blocks are written to "
                        "DIR in the background and read back by later prompts, also after "
                        "a restart (one subdirectory per model, dtype and KV layout; "
                        "servers may share DIR)")
    g.add_argument("--kv-store-max-gib", type=float, default=d.kv_store_max_gib,
                   help="size cap of --kv-store in GiB; least recently used blocks are "
                        "deleted beyond it (default %(default)s)")


def _add_scheduler_arguments(g: argparse._ArgumentGroup) -> None:
    """The step budget and the queues."""
    d = EngineConfig()
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="fixed token budget per step (prefill chunks + decodes); default: "
                        "derived per step from --max-step-ms and the step-time model")
    g.add_argument("--max-step-ms", type=float, default=d.max_step_ms,
                   help="target step time that sets the default token budget (default: "
                        "1.5x a small decode step, measured)")
    g.add_argument("--step-time", default=d.step_time, metavar="JSON",
                   help="step-time model to schedule with, as `duet serve --print-config` "
                        "shows it (that file works as is): nothing is measured, so the "
                        "budget is the same on any machine; default: measured at start-up "
                        "(cached per machine and kernel switches)")
    g.add_argument("--scheduling-policy", default=d.scheduling_policy,
                   choices=list(SCHEDULING_POLICIES),
                   help="slo (default): goodput first, steps widened by the running "
                        "streams' TPOT slack, admission bounded by the TPOT target, "
                        "waiting order by TTFT deadline; fcfs: the step-time target alone, "
                        "arrival order")
    g.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms,
                   help="time-to-first-token target the scheduler plans for (default "
                        "%(default)s); a request may relax it (slo_ttft_ms in its body)")
    g.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_ms,
                   help="time-per-output-token target the scheduler plans for (default "
                        "%(default)s: 10 tokens/s, ahead of fast reading); a request may "
                        "relax it (slo_tpot_ms)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="cap on running requests")
    g.add_argument("--max-n", type=int, default=d.max_n,
                   help="cap on samples per request, n (default %(default)s)")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="refuse new requests (HTTP 503) while this many wait; 0 = no cap "
                        "(default %(default)s)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off")


def _add_kernel_switches(k: argparse._ArgumentGroup) -> None:
    """The switches that change which kernels run (all in the step-time cache key)."""
    k.add_argument("--no-native-kernels", dest="native_kernels", action="store_false",
                   help="plain torch instead of duetserve's C++ kernels (slower, same "
                        "results within rounding)")
    k.add_argument("--no-decode-stack", dest="decode_stack", action="store_false",
                   help="run decode steps through the per-layer modules instead of one "
                        "native call")
    k.add_argument("--kquant-forms", default=EngineConfig().kquant_forms,
                   choices=list(KQUANT_FORMS),
                   help="GGUF Q4_K/Q6_K weights: keep their exact forms, widen them to "
                        "int4/int8, or measure which is faster here (default)")
    k.add_argument("--no-amx", dest="amx", action="store_false",
                   help="run many-row steps of low-bit weights on the dense path even where "
                        "the CPU has AMX (by default AMX bf16 tiles run them when measured "
                        "faster)")
    k.add_argument("--prefill-attention", default=EngineConfig().prefill_attention,
                   choices=list(PREFILL_ATTENTION),
                   help="prompt chunks' attention on a low-bit model: bfloat16 dot products "
                        "(AVX512-BF16, or torch's bf16 flash beside AMX), float32, or auto: "
                        "bfloat16 where the CPU has it and it measured faster (default)")
    k.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help="leave the weights in the allocator's pages (default: moved into "
                        "2 MiB pages where the kernel offers transparent huge pages)")
    k.add_argument("--deterministic", action="store_true",
                   help="the same tokens whatever shares a step, the chunking or the prefix "
                        "cache: every step runs the per-row kernels (slower prefill; "
                        "docs/deterministic.md)")
    k.add_argument("--check-integrity-when-idle", action="store_true",
                   help="debug: check the scheduler's queues, block tables and block pool "
                        "every time the engine goes idle")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return EngineConfig(
            model=getattr(args, "model_pos", None) or args.model, dtype=args.dtype,
            quantization=args.quantization,
            max_model_len=args.max_model_len, block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
            kv_prefault=args.kv_prefault, native_kernels=args.native_kernels,
            kv_store=args.kv_store, kv_store_max_gib=args.kv_store_max_gib,
            decode_stack=args.decode_stack, kquant_forms=args.kquant_forms,
            huge_pages=args.huge_pages, deterministic=args.deterministic, amx=args.amx,
            prefill_attention=args.prefill_attention,
            step_time=args.step_time,
            check_integrity_when_idle=args.check_integrity_when_idle,
            max_num_batched_tokens=args.max_num_batched_tokens, max_step_ms=args.max_step_ms,
            scheduling_policy=args.scheduling_policy, slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms, max_num_seqs=args.max_num_seqs, max_n=args.max_n,
            max_waiting_requests=args.max_waiting_requests,
            enable_prefix_caching=args.enable_prefix_caching, num_threads=args.num_threads,
            seed=args.seed, trace_file=args.trace_file,
            speculative_config=getattr(args, "speculative_config", None),
            lora_modules=tuple(args.lora_modules), max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank, lora_dtype=args.lora_dtype)
    except ConfigError as e:
        raise UserError(str(e)) from None


def build_engine(args: argparse.Namespace, kv_transfer=None):
    """EngineCore from flags; checkpoint problems (and a KV transfer backend that cannot
    start) become one-line UserErrors. `kv_transfer`: a KVTransferConfig (serve --role)."""
    from duetserve.engine.engine_core import EngineCore
    from duetserve.errors import DuetError
    from duetserve.kv_transfer.backends import TransferError
    try:
        return EngineCore(engine_config_from_args(args), kv_transfer=kv_transfer)
    except (DuetError, TransferError, ConfigError) as e:
        raise UserError(str(e)) from None


def stream_to_stdout(engine):
    """Step `engine` until it has no work, printing the first sample's new text as it
    comes. Returns the last cumulative RequestOutput (None if nothing ran)."""
    import sys

    acc, out = OutputAccumulator(), None
    while engine.has_unfinished_requests():
        for delta in engine.step_deltas():
            first = [o for o in delta.outputs if o.index == 0]
            if first and first[0].text:
                sys.stdout.write(first[0].text)
                sys.stdout.flush()
            out = acc.add(delta)
    return out
