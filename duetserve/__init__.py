"""duetserve: an LLM inference and serving engine that treats prefill and decode as two
workloads. `from duetserve import LLM, SamplingParams`."""
from __future__ import annotations

from duetserve.request import LoRARequest
from duetserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so light tools (`duet bench serve`) stay light.
    if name == "LLM":
        from duetserve.engine.llm import LLM
        return LLM
    raise AttributeError(name)
