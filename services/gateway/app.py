"""The OpenAI-compatible HTTP front: FastAPI routes over an `OpenAIServing`.

Routes are thin: requests go to `serving.py`, every error through the one mapping in
`errors.py`, the limits middleware (`limits.py`) before any route reads a byte.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from opentelemetry import trace
from prometheus_fastapi_instrumentator import Instrumentator

from shared.version import llmbus_version
from services.gateway.api_keys import ApiKeys
from services.gateway.event_stream import GatewayApp
from services.gateway.errors import BadRequest, GatewayError, NoRoute, NotFound, Unavailable, error_response
from services.gateway.limits import Limits
from services.gateway.lora_modules import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.gateway.request_ids import RequestIdHeader
from services.gateway.responses_api.items import input_items
from services.gateway.responses_api.answer import ResponsesAnswer
from services.gateway.responses_api.request import ResponsesRequest
from services.gateway.serving import OpenAIServing
from services.gateway import tokenization
from services.gateway.pooling import classification, embeddings, scoring
from shared.config import GatewayConfig

LLMBUS_VERSION = llmbus_version()
log = logging.getLogger("llmbus.gateway")


def create_app(client_factory, tokenizer, config: GatewayConfig, tracer=None, join_peers=None) -> FastAPI:
    """`client_factory(on_stats)` is awaited at startup and returns a started engine client
    (engine.Engine); `join_peers(serving, client)`, where given, is awaited next: it joins
    the deployment's other gateways (the shell's; a test's app stands alone)."""
    metrics = GatewayMetrics(config.model_name)
    keys = ApiKeys(config.api_keys, config.api_key_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if keys.key_file is not None:
            try:  # SIGHUP reads the key file again; only the main thread's loop can take it
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keys.reload)
            except (RuntimeError, ValueError, NotImplementedError):
                pass  # an app run in a test's thread
        client = await client_factory(metrics.observe_stats)
        tracer_ = tracer or trace.get_tracer("llmbus.gateway")
        app.state.serving = OpenAIServing(client, tokenizer, config, metrics, tracer_)
        if join_peers is not None:
            await join_peers(app.state.serving, client)
        yield
        close = getattr(client, "aclose", None)
        if close is not None:
            await close()

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if config.disable_fastapi_docs else {}
    app = GatewayApp(title="llmbus", lifespan=lifespan, **docs)
    # vLLM's HTTP series (the library and the handlers left out are vLLM's), on this
    # gateway's registry: /metrics sums them over sibling gateways as the other request series
    Instrumentator(excluded_handlers=["/metrics", "/health", "/load", "/ping", "/version", "/server_info"],
                   registry=metrics.registry).instrument(app)
    app.add_middleware(Limits, config=config, keys=keys)
    # Outside the key check (added last, it runs first): a browser's preflight carries no key.
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)
    if config.enable_request_id_headers:  # outermost: a 401 or a preflight carries it too
        app.add_middleware(RequestIdHeader)

    async def on_error(_request: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def on_routing_error(request: Request, exc: HTTPException) -> Response:
        message = (f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404
                   else f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405
                   else str(exc.detail))
        return error_response(NoRoute(message, exc.status_code))

    # Ours, routing's (an unknown path, a wrong method: OpenAI's "Invalid URL"), and anything
    # unforeseen: in OpenAI's shape rather than FastAPI's {"detail": ...} or plain text.
    app.add_exception_handler(GatewayError, on_error)
    app.add_exception_handler(HTTPException, on_routing_error)
    app.add_exception_handler(Exception, on_error)

    def serving(request: Request) -> OpenAIServing:
        return request.app.state.serving

    # vLLM's (SageMaker's probe): /health's answer (left out of the API's description: one
    # function under two methods would name one operation twice)
    @app.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    @app.get("/health")
    async def health(request: Request):
        try:
            info = await serving(request).client.scheduler_info(max_age_s=0.0)
        except Unavailable as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc)}, status_code=503)
        if info.num_workers < 1:
            return JSONResponse({"status": "unavailable", "reason": "no worker has joined"}, status_code=503)
        stats = None
        if info.stats is not None:
            stats = msgspec.to_builtins(msgspec.structs.asdict(info.stats))
        return {
            "status": "ok",
            "model": config.model_name,
            "workers": info.num_workers,
            # the scheduler shards (--data-parallel-size) and their workers
            "shards": {str(rank): workers for rank, workers in info.shard_workers.items()},
            "max_model_len": info.max_model_len,
            "stats": stats,
        }

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        return Response(await serving(request).port_metrics.exposition(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def model_cards(request: Request) -> list[dict]:
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "llmbus",
                "root": config.model_name, "parent": None}
        try:  # vLLM's card says the context too, once a worker has joined (it is the workers' to know)
            info = await serving(request).client.scheduler_info()
            if info.num_workers >= 1:
                card["max_model_len"] = info.max_model_len
        except Unavailable:
            pass
        # vLLM's cards for the adapters: their own id, the base model as parent
        adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "llmbus", "root": lora.lora_path,
                     "parent": config.model_name} for name, lora in serving(request).loras.items()]
        aliases = [{**card, "id": alias} for alias in config.model_aliases]  # vLLM's: a card per served name
        return [card, *aliases, *adapters]

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": await model_cards(request)}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (an id may hold a slash: org/name)
    async def model(request: Request, model: str):
        for card in await model_cards(request):
            if card["id"] == model:
                return card
        raise NotFound(f"the model `{model}` does not exist", "model", "model_not_found")

    if config.allow_runtime_lora_updating:  # vLLM's answers: plain text on success
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            s = serving(request)
            body = parse_body(await s.read_body(request), LoadLoRAAdapterRequest)
            try:
                info = await s.client.scheduler_info()
                max_rank = info.max_lora_rank if info.num_workers >= 1 else None
            except Unavailable:
                max_rank = None  # (no worker to ask: the first to run it checks)
            lora = s.loras.load(body, max_rank)
            log.warning("LoRA adapter %r loaded from %s (id %d)", lora.lora_name, lora.lora_path, lora.lora_int_id)
            return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            s = serving(request)
            lora = s.loras.unload(parse_body(await s.read_body(request), UnloadLoRAAdapterRequest))
            log.warning("LoRA adapter %r unloaded", lora.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving(request).handle(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving(request).handle(request, ChatCompletionRequest)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await serving(request).handle(request, ResponsesRequest, ResponsesAnswer)

    def no_response(response_id: str) -> NotFound:
        return NotFound(f"Response with id '{response_id}' not found.", "response_id")

    # OpenAI's retrieve and delete of a stored response (store.py)
    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str):
        if request.query_params.get("stream", "false").lower() != "false":
            raise BadRequest("a stored response is sent whole: streaming it again is not supported", "stream")
        entry = await serving(request).responses.find(response_id)
        if entry is None:
            raise no_response(response_id)
        return Response(entry.response, media_type="application/json")

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str):
        entry = await serving(request).responses.find(response_id)
        if entry is None:
            raise no_response(response_id)
        return input_items(response_id, entry, dict(request.query_params))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        if not await serving(request).responses.delete(response_id):
            raise no_response(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request):
        return await embeddings.embeddings(serving(request), request)

    # vLLM's score and rerank over an embedding model (scoring.py), at each path vLLM serves them
    async def create_score(request: Request):
        return await scoring.score(serving(request), request)

    async def create_rerank(request: Request):
        return await scoring.rerank(serving(request), request)

    for path in ("/score", "/v1/score"):
        app.post(path)(create_score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(create_rerank)

    async def create_classification(request: Request):  # vLLM's, over a sequence classifier
        return await classification.classify(serving(request), request)

    for path in ("/classify", "/v1/classify"):
        app.post(path)(create_classification)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenization.tokenize(serving(request), request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokenization.detokenize(serving(request), request)

    if config.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return tokenization.tokenizer_info(tokenizer)

    if config.server_load_tracking:
        @app.get("/load")  # vLLM's (--enable-server-load-tracking): what a load balancer reads
        async def load(request: Request):
            return {"server_load": serving(request).server_load}

    @app.get("/version")
    async def version():
        return {"version": LLMBUS_VERSION}

    return app
