"""Steps that carry prompt chunks, with the chunks laid out as decode rows of the in-place
paged kernel (worker/batch.py, CHUNK_AS_DECODE_ROWS) against as prefill slices.

Whole steps through the engine's runner (step_cost._time_step: probe requests built into
the KV cache before any real request), the default model unless --model, the two layouts
alternating --repeats times, each timing the median of 5 after a warm-up. Decodes are at
context 128; "@N" is a chunk after N cached tokens. Prints a table, writes JSON.

    /tmp/gate.sh env PYTHONPATH=. .venv/bin/python benchmarks/chunk_layout.py \\
        --out out/chunk_layout/run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

SHAPES = {
    "1 decode + 7": [(128, 1), (7, 7)],
    "1 decode + 31": [(128, 1), (31, 31)],
    "4 decodes + 60": [(128, 1)] * 4 + [(60, 60)],
    "8 decodes + 60": [(128, 1)] * 8 + [(60, 60)],
    "1 decode + 64 @512": [(128, 1), (576, 64)],
    "16 decodes + 48": [(128, 1)] * 16 + [(48, 48)],
    "40 decodes + 32": [(128, 1)] * 40 + [(32, 32)],
    "64-token prompt": [(64, 64)],
    "48 @256": [(304, 48)],
    "two 40-token prompts": [(40, 40), (40, 40)],
    "1 decode + 2 @128": [(128, 1), (130, 2)],
    "1 decode + 8 @128": [(128, 1), (136, 8)],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="out/chunk_layout/run")
    args = ap.parse_args()
    import duetserve.worker.batch as batch
    from duetserve.engine.llm import LLM
    from duetserve.engine.step_cost import _time_step
    engine = LLM(args.model, num_threads=args.threads).engine
    runner, vocab, bs = engine.runner, engine.model_config.vocab_size, engine.config.block_size
    rows_limit = batch.CHUNK_AS_DECODE_ROWS

    def timed(seqs) -> float:
        _time_step(runner, seqs, vocab, bs)
        return statistics.median(_time_step(runner, seqs, vocab, bs) for _ in range(5))
    res: dict[str, dict[str, list[float]]] = {k: {"rows": [], "prefill": []} for k in SHAPES}
    try:
        for _ in range(args.repeats):
            for limit, name in ((rows_limit, "rows"), (0, "prefill")):
                batch.CHUNK_AS_DECODE_ROWS = limit
                for key, seqs in SHAPES.items():
                    res[key][name].append(timed(seqs))
    finally:
        batch.CHUNK_AS_DECODE_ROWS = rows_limit
    table = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in res.items()}
    print("| step | chunk as decode rows (ms) | chunk as prefill (ms) | ratio |")
    print("|---|---|---|---|")
    for key, t in table.items():
        print(f"| {key} | {t['rows']:.2f} | {t['prefill']:.2f} | "
              f"{t['rows'] / t['prefill']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunk_layout.json").write_text(json.dumps(
        {"args": vars(args), "chunk_as_decode_rows": rows_limit, "medians_ms": table,
         "runs_ms": res}, indent=1))
    print(f"wrote {out / 'chunk_layout.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
