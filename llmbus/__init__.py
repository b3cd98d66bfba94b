"""llmbus: an LLM serving engine in the shape of vLLM V1, cut into services over NATS."""

from llmbus.inputs import TextPrompt, TokensPrompt
from shared.processing.beam_search import BeamSearchParams
from shared.lora_request import LoRARequest
from shared.messages import Logprob
from shared.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "BeamSearchParams", "LoRARequest",
           "RequestOutput", "CompletionOutput", "Logprob", "TextPrompt", "TokensPrompt"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; importing llmbus for SamplingParams should not.
    if name == "LLM":
        from llmbus.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from llmbus import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
