"""EOS ids are resolved once, at load: a HF folder whose config.json names no EOS but whose
generation_config.json or tokenizer does gets that id everywhere, so the stop check and
`min_tokens` suppression agree (they used to read different sources)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.loader import load_model
from duetserve.sampling_params import SamplingParams

EOS = 299      # "</s>" in the tiny byte tokenizer


def _folder_without_config_eos(src: str, dst: str, source: str) -> str:
    """A copy of `src` whose config.json names no EOS; `source` ("tokenizer" or
    "generation_config") is the only file that does."""
    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("eos_token_id", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    gen = os.path.join(dst, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    if source == "tokenizer":
        with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "</s>", "bos_token": "<s>"}, f)
    else:
        tcfg = os.path.join(dst, "tokenizer_config.json")
        if os.path.exists(tcfg):
            os.remove(tcfg)
        with open(gen, "w") as f:
            json.dump({"eos_token_id": EOS}, f)
    return dst


@pytest.mark.parametrize("source", ["tokenizer", "generation_config"])
def test_one_eos_for_stop_check_and_min_tokens(tiny_checkpoints, tmp_path, source):
    path = _folder_without_config_eos(tiny_checkpoints["llama-gqa-tied"], str(tmp_path / "m"),
                                      source)
    loaded = load_model(path)
    assert loaded.config.eos_token_ids == (EOS,)
    eng = EngineCore(EngineConfig(model=path, num_threads=2, kv_cache_memory=0.01,
                                  max_num_batched_tokens=256,
                                  check_integrity_when_idle=True), loaded=loaded)
    assert eng.eos_token_ids == eng.runner.sampler.eos_token_ids == (EOS,)
    assert eng.tokenizer.eos_token_ids == (EOS,)
    # EOS is made certain by a bias: min_tokens must hold it off for 3 tokens, then the
    # stop check must end the request on it.
    eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, min_tokens=3,
                                                   logit_bias={EOS: 100.0}))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    c = out.outputs[0]
    assert EOS not in c.token_ids[:3]
    assert len(c.token_ids) == 4 and c.token_ids[3] == EOS and c.finish_reason == "stop"
