"""LLM.generate's prompt forms (issue 63 item 5): strings, token id lists and vLLM's
prompt dicts ({"prompt": text}, {"prompt_token_ids": ids}), one or a list, mixed; a
clear error for anything else, raised before anything is queued (tiny random model)."""
from __future__ import annotations

import pytest

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.llm import LLM
from duetserve.errors import RequestError
from duetserve.loader import load_model
from duetserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    loaded = load_model(tiny_checkpoints["llama-gqa-untied"])
    cfg = EngineConfig(model=loaded.path, num_threads=2, block_size=4,
                       max_num_batched_tokens=64, num_gpu_blocks_override=128)
    return LLM.from_engine(EngineCore(cfg, loaded=loaded))


def test_every_form_mixed_in_one_list(llm) -> None:
    text = "Hello there"
    ids = llm.tokenizer.encode(text)
    outs = llm.generate([text, ids, {"prompt": text}, {"prompt_token_ids": ids},
                         tuple(ids)], GREEDY)
    assert [o.prompt for o in outs] == [text, None, text, None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outs)


@pytest.mark.parametrize("one", ["Hi", [5, 6, 7], {"prompt": "Hi"},
                                 {"prompt_token_ids": [5, 6, 7]}])
def test_a_single_prompt_of_each_form(llm, one) -> None:
    (out,) = llm.generate(one, GREEDY)
    assert out.finished and len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("prompts,error,words", [
    ([{"prompt_token_ids": [1, 2], "multi_modal_data": {}}], ValueError,
     ["prompt 0", "multi_modal_data"]),
    ([{"prompt": "a", "prompt_token_ids": [1]}], ValueError, ["exactly one"]),
    ([{}], ValueError, ["exactly one"]),
    (["ok", {"prompt": 3}], TypeError, ["prompt 1 (prompt)", "string"]),
    ([{"prompt_token_ids": "abc"}], TypeError, ["prompt_token_ids", "list of token ids"]),
    ([[1, 2.5]], TypeError, ["prompt 0", "2.5"]),
    ([[1, True]], TypeError, ["True"]),
    ([[]], ValueError, ["empty"]),
    ([["a"]], TypeError, ["'a'"]),
    (5, TypeError, ["got int"]),
    ([None], TypeError, ["prompt 0", "NoneType"]),
])
def test_anything_else_is_a_clear_error(llm, prompts, error, words) -> None:
    with pytest.raises(error) as e:
        llm.generate(prompts, GREEDY)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_a_refused_prompt_leaves_nothing_queued(llm) -> None:
    """The first two prompts are valid and queued when the third is refused: they are
    aborted, their blocks freed, and the next call runs only its own prompts."""
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestError, match="not in the vocabulary"):
        llm.generate(["a", [5, 6], [vocab + 1]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0
    assert llm.engine.last_step.num_used_blocks == 0       # what /load reads
    assert [o.prompt for o in llm.generate(["b"], GREEDY)] == ["b"]
