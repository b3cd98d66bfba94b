"""What answering a request needs of the gateway, apart from preparing it (serving.py):
the engine, the tokenizer, the config, metrics and tracer, the LoRA modules, logprobs'
formatting, the stored responses and the /load count. Answers (answer.py,
beam_search_answer.py, responses_api/) take this, never the whole OpenAIServing."""

from __future__ import annotations

from services.gateway import response_bodies as r
from services.gateway.engine import Engine
from services.gateway.lora_modules import LoRAModules
from services.gateway.metrics import GatewayMetrics, OwnMetrics
from services.gateway.responses_api.store import ResponseStore, StoredHere
from shared.config import GatewayConfig
from shared.lora_request import LoRARequest


class ServingContext:
    def __init__(self, client: Engine, tokenizer, config: GatewayConfig, metrics: GatewayMetrics, tracer) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.tracer = tracer
        self.loras = LoRAModules(config.model_name, config.lora_modules)
        self.logprobs = r.LogprobsFormatter(tokenizer.backend)
        self.logprobs_as_ids = r.LogprobsFormatter(tokenizer.backend, as_token_ids=True)
        # The Responses API's stored responses, and /metrics: this gateway's own, until the
        # shell joins it to the deployment's other gateways (shell/service.py).
        self.responses = StoredHere(ResponseStore(config.responses_store_bytes))
        self.port_metrics = OwnMetrics(metrics)
        self.server_load = 0  # requests being answered (vLLM's /load)

    def lora_of(self, model: str | None) -> LoRARequest | None:
        """The adapter a (checked) model name asks for; None for the base model."""
        return self.loras.get(model)

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter asked for, else the base model."""
        return model if model in self.loras else self.config.model_name
