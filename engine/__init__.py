"""Tandem's model runtime, shared by the prefill and decode workers."""

from engine.llm import LLM
from engine.request import RequestOutput
from engine.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
