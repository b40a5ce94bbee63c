"""kvserve: an LLM inference engine built around a paged KV cache."""
# Before anything imports torch: OpenMP reads its thread count and spin once, as torch loads.
from kvserve.threads import configure_environment

configure_environment()

from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.llm import LLM  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.engine.sequence import RequestOutput  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams"]
