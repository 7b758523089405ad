"""Test helper: GGUF K-quant blocks that gguf-py cannot quantize itself."""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q


def k_quant_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks [rows, bytes] with finite fp16 super-block scales (0.01)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    scale = np.full((raw.shape[0], 1), 0.01, np.float16).view(np.uint8)
    if qtype == Q.Q6_K:          # d is the last 2 bytes
        raw[:, -2:] = scale
    else:                        # d, dmin are the first 4 bytes
        raw[:, 0:2] = scale
        raw[:, 2:4] = scale
    return raw.reshape(rows, -1)
