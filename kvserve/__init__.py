"""kvserve: an LLM inference engine built around a paged KV cache."""
from kvserve.config import EngineConfig
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.sequence import RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams"]
