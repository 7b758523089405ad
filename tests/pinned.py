"""What tests pin so that no outcome depends on this machine's speed: a step-time model
file for engines whose step budget or speculation policy is not what the test measures
(`EngineConfig(step_time=pinned_step_time())`, `duet serve --step-time`)."""
from __future__ import annotations

import json
import os

from duetserve.core.step_time import Layout, StepTime

# Shaped like the default model on a 2-core CPU (decode steps of a few ms, a cliff past
# 16 rows); only its arithmetic matters to the tests.
PINNED = StepTime.of(Layout(few_rows=16, chunk_rows=64, masked_max_scores=58254),
                     few_step=0.004, few_row=0.0003, mixed_step=0.008, mixed_row=0.0004,
                     many_step=0.012, many_row=0.0005, logit=0.00005, decode_kv=2e-8,
                     decode_kv_reread=2e-8,
                     chunk_score=3e-9, chunk_pair=1e-9)


def pinned_step_time() -> str:
    """Path of PINNED as a JSON file in the session's cache directory (conftest points
    DUET_CACHE_DIR at a temporary one)."""
    path = os.path.join(os.environ["DUET_CACHE_DIR"], "pinned_step_time.json")
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump(PINNED.to_json(), f)
    return path
