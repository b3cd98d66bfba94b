"""The offline API: the engine core with the model runner in this process.

The scheduler service drives the very same `EngineCore` (two steps in flight by
default) with a NATS executor; here its executor calls the model runner directly. The
engine's event loop runs on the runner's own thread (services/worker/executor.py says
why), so every torch call stays on that one thread, and `generate` works the same from
plain code and from code that already runs an event loop (a notebook): the caller's
thread only waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import TypeVar

import msgspec
from tqdm import tqdm

from llmbus.inputs import Prompt, is_one_prompt, parse_prompt
from llmbus.llm_apis import GenerateBasedAPIs
from llmbus.model_fetch import resolve_model, resolve_tokenizer, with_draft_resolved, with_hf_overrides
from llmbus.outputs import CompletionOutput, RequestOutput
from services.scheduler.engine_core import EngineCore
from services.scheduler.core.scheduler import Scheduler
from services.tokenizer.images import ImagePrompts
from services.tokenizer.tokenizer import Tokenizer
from services.worker.executor import InProcessExecutor
from services.worker.parallel.ranks import build_runner
from shared.hf.classification import classifier_of
from shared.engine_args import EngineArgs
from shared.kv_events import KVEventsConfig
from shared.gc_heap import frozen_heap
from shared.hf.generation_config import default_sampling, model_eos_ids, stop_at_model_eos
from shared.lora_request import LoRARequest
from shared.messages import EngineCoreOutputs, PromptWithImages, SchedulerStats
from shared.processing.output_processor import ParentRequest
from shared.hf.image_models import image_model, no_images_why
from shared.hf.pooling_config import unsupported_pooling
from shared.sampling_params import RequestOutputKind, SamplingParams, with_bad_words_tokenized

T = TypeVar("T")


class LLM(GenerateBasedAPIs):
    """vLLM's offline LLM: the engine, `generate` and `step` (chat, embed, ...: llm_apis.py)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        """`kwargs`: EngineArgs' fields (shared/engine_args.py), by vLLM's names; one it does
        not know is a TypeError naming it."""
        args = EngineArgs(model=model, **kwargs)
        if args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size}: the offline engine is one scheduler and "
                             "one worker; shards are served (llmbus serve --data-parallel-size N)")
        if KVEventsConfig.parse(args.kv_events_config) is not None:
            raise ValueError("kv_events_config: KV events go out on a served deployment's bus; the offline engine "
                             "has none")
        path = with_hf_overrides(resolve_model(model, args.revision, args.download_dir), args.hf_overrides)
        tokenizer_path = (None if args.tokenizer is None
                          else str(resolve_tokenizer(args.tokenizer, download_dir=args.download_dir)))
        self.default_sampling = default_sampling(path, args.generation_config, args.override_generation_config)
        self.model_eos_ids = model_eos_ids(path, args.generation_config)  # ending requests beside the tokenizer's EOS
        self.unsupported_pooling = unsupported_pooling(path)  # read once, as the gateway does
        self.classifier = classifier_of(path)  # a *ForSequenceClassification's labels
        args.speculative_config = with_draft_resolved(args.speculative_config, args.download_dir)
        # An unsupported model fails in the runner's constructor, before any weight loads.
        worker_config = args.worker_config(tokenizer_path)
        self.executor = InProcessExecutor(lambda: build_runner(path, worker_config, args.threads), args.threads)
        self.runner = self.executor.runner
        self.tokenizer = Tokenizer(tokenizer_path or path)
        self.model_path, self._images = path, None  # (images: _image_prompts)
        self.image_limit = args.limit_mm_per_prompt.get("image", math.inf)  # (0: the runner has no encoder)
        self.scheduler = Scheduler.for_worker(args.scheduler_config(self.runner.max_model_len),
                                              self.runner.describe())
        self.engine = EngineCore(self.scheduler, self.executor, 2 if args.async_scheduling else 1)
        self.eos_token_id = self.tokenizer.eos_token_id
        self._ids = itertools.count()
        # engine request id -> (its client request, what `generate` returns for it)
        self._requests: dict[str, tuple[ParentRequest, RequestOutput]] = {}
        self._loop = asyncio.new_event_loop()  # run on the runner's thread, call by call
        # Closed when this LLM is collected: left to the collector, an unclosed loop's own
        # finalizer may run after its self-pipe socket's and fail on the closed descriptor
        # ("Exception ignored in BaseEventLoop.__del__", with a traceback).
        weakref.finalize(self, self._loop.close)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def get_tokenizer(self):
        """vLLM's: the model's Hugging Face tokenizer (its vocabulary, chat template,
        `apply_chat_template`), the one prompts are encoded with."""
        return self.tokenizer.hf

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix, so the next prompts compute from scratch (a
        benchmark's cold start). False, changing nothing, while a request holds blocks."""
        return self.scheduler.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation config over SamplingParams' defaults, what
        `generate` and `chat` use when given no sampling params."""
        return SamplingParams(**self.default_sampling)

    # ---- public API -------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: vLLM's, one per prompt (lower first), with scheduling_policy="priority".
        `lora_request`: vLLM's, the adapter for every prompt or one (or None) per prompt,
        with enable_lora=True."""
        if is_one_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        # Only the finished outputs are returned (vLLM's generate asks for FINAL_ONLY too);
        # one copy a distinct params object (a batch mostly shares one).
        distinct = {id(p): p for p in params_list}
        final_only = {key: _final_only(p) for key, p in distinct.items()}
        params_list = [final_only[id(p)] for p in params_list]
        with frozen_heap():  # (adding a batch's requests makes enough objects to start a collection too)
            results = self.add_requests(prompts, params_list, priority, lora_request)
            pending = {seq_id for r in results for seq_id in self._children(r)}
            with tqdm(total=len(pending), disable=not use_tqdm, desc="generate", unit="req") as bar:
                def landed(finished: list[str]) -> None:
                    for done in finished:
                        if done in pending:
                            pending.discard(done)
                            bar.update()

                self.step_while(lambda: bool(pending), landed)
        return results

    def step_while(self, keep_going: Callable[[], bool], on_step: Callable[[list[str]], None] | None = None) -> None:
        """`step()` while `keep_going()`, every step in one call on the engine's thread: a
        hand-over per step costs ~0.1 ms, against the ~1.5 ms of a GPU's whole decode step
        (generate steps so; a benchmark timing steps should too). `on_step(finished)` is
        called on the engine's thread after each step. A Ctrl-C in the caller stops the
        steps after the one under way (as it did between `step()` calls)."""
        stop = threading.Event()

        async def steps() -> None:
            while keep_going() and not stop.is_set():
                finished = await self._step()
                if on_step is not None:
                    on_step(finished)

        # The hand-over inside the try: a Ctrl-C that lands between it and the wait (a busy
        # machine can leave this thread unscheduled while the engine's lands steps) must stop
        # the steps too, not leave them running to their last token.
        # The caller's heap (the model, torch's modules: ~480k objects) out of the
        # collector's sight while the steps run, so none pauses them to walk it (gc_heap.py).
        running: concurrent.futures.Future | None = None
        try:
            with frozen_heap():
                running = self.executor.submit(self._loop.run_until_complete, steps())
                running.result()
        except BaseException:
            stop.set()  # (set before the steps began, none runs)
            if running is not None:
                concurrent.futures.wait([running])
            raise

    # ---- the engine -------------------------------------------------------------------

    def step(self) -> list[str]:
        """Land one engine step (filling the pipeline first); returns the ids of the
        sequences that finished in it. Once nothing is left unfinished, whatever is still
        in flight is landed too, so an idle engine holds no step and no worker state."""
        return self.run_in_engine(self._step())

    async def _step(self) -> list[str]:
        landed = await self.engine.step()
        finished = self._process(landed.outputs) if landed is not None else []
        if not self.scheduler.has_unfinished_requests():
            for rest in await self.engine.drain():
                finished += self._process(rest.outputs)
        return finished

    def _process(self, outputs: dict[str, EngineCoreOutputs]) -> list[str]:
        finished = []
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                entry = self._requests.get(out.request_id)
                delta = entry[0].apply(out) if entry is not None else None
                if delta is None:
                    continue
                result = entry[1]
                if delta.prompt_logprobs and delta.index == 0:  # (each choice has them: the same prompt)
                    result.prompt_logprobs.extend(lp.by_token(self._token_text) for lp in delta.prompt_logprobs)
                if delta.pooled is not None:
                    result.embedding = delta.pooled
                if delta.needs_abort:
                    self.scheduler.abort_requests([out.request_id])
                completion = result.outputs[delta.index]
                completion.text += delta.text
                completion.token_ids.extend(delta.token_ids)
                if completion.logprobs is not None:
                    completion.logprobs.extend(lp.by_token(self._token_text) for lp in delta.logprobs)
                result.num_cached_tokens = delta.num_cached_tokens
                if delta.finish_reason is None:
                    continue
                completion.finish_reason = str(delta.finish_reason)
                completion.stop_reason = delta.stop_reason
                del self._requests[out.request_id]
                result.finished = all(o.finish_reason is not None for o in result.outputs)
                if delta.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed in the engine: {delta.error}")
                finished.append(out.request_id)
        return finished

    def _token_text(self, token_id: int) -> str:
        """A logprob's `decoded_token`: the token decoded alone (as vLLM's)."""
        return self.tokenizer.backend.decode([token_id], skip_special_tokens=False)

    def run_in_engine(self, coro: Coroutine[None, None, T]) -> T:
        """Run a coroutine on the engine's event loop, on the runner's thread; the caller
        waits (from any thread, a running event loop's included)."""
        return self.executor.call(self._loop.run_until_complete, coro)

    def _children(self, result: RequestOutput) -> list[str]:
        return [f"{result.request_id}-{o.index}" for o in result.outputs]

    def add_requests(self, prompts: list[Prompt], params_list: list[SamplingParams],
                     priority: Sequence[int] | None = None,
                     lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Queue without running (drive the engine with `step()`; `generate` does both).
        Everything is validated first: on any error nothing is left queued. Each step adds
        to a completion's `token_ids` (and logprobs), or, with `output_kind` FINAL_ONLY
        (`generate`'s) and no stop strings, its finishing step adds them all; its `text` is
        set when it finishes (it grows with the tokens only for a request with stop strings)."""
        encoded = []
        for prompt, params in zip(prompts, params_list):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
            if params.output_kind == RequestOutputKind.DELTA:
                # (Each RequestOutput here grows in place: one of only the new tokens would
                # be a different object a step, which this API does not hand out.)
                raise ValueError("output_kind DELTA is not taken offline: an LLM's outputs grow step by step "
                                 "(CUMULATIVE) or come whole when they finish (FINAL_ONLY)")
            if params.structured_outputs is not None:
                # Compiled here, before anything is queued: a bad spec is the caller's
                # error, never a failed step that takes the batch beside it down.
                self.executor.call(self.runner.grammars.check, params.structured_outputs)
            parsed = parse_prompt(prompt)
            features = []
            images = len(prompt.mm_features) if isinstance(prompt, PromptWithImages) else len(parsed.images or ())
            if images > self.image_limit:
                raise ValueError(f"a prompt holds {images} image(s), more than limit_mm_per_prompt's "
                                 f"{self.image_limit}")
            if isinstance(prompt, PromptWithImages):  # (a chat with images: chat() encoded them)
                token_ids, features = list(prompt), prompt.mm_features
            elif parsed.images:  # (preprocessed as a tokenizer replica does)
                token_ids, features = self._image_prompts().encode(parsed.text, list(parsed.images))
            else:
                token_ids = parsed.token_ids if parsed.token_ids is not None else self.tokenizer.encode(parsed.text)
            encoded.append((parsed.text, token_ids, parsed.cache_salt, features))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        loras = self._loras(lora_request, len(prompts))
        added: list[str] = []
        results = []
        try:
            for (text, token_ids, salt, features), params, rank, lora in zip(
                    encoded, params_list, priority or [0] * len(prompts), loras):
                params = stop_at_model_eos(params, self.model_eos_ids, self.eos_token_id)
                params = with_bad_words_tokenized(params, lambda w: self.tokenizer.encode(w, add_special_tokens=False))
                result = RequestOutput(str(next(self._ids)), text, token_ids)
                if params.prompt_logprobs is not None:
                    result.prompt_logprobs = [None]
                # The text is decoded once a completion is over (as it grows only when stop
                # strings are looked for): what generate() returns is the same, for a
                # fraction of the host's work a step.
                parent = ParentRequest(
                    result.request_id, token_ids, params, self.tokenizer.backend, self.eos_token_id, time.time(),
                    incremental=False, priority=rank, lora_request=lora, cache_salt=salt, mm_features=features,
                )
                for index, request in enumerate(parent.engine_requests):
                    self.scheduler.add_request(request)
                    added.append(request.request_id)
                    result.outputs.append(CompletionOutput(
                        index=index, text="", token_ids=[], finish_reason=None,
                        logprobs=[] if params.logprobs is not None else None,
                    ))
                    self._requests[request.request_id] = (parent, result)
                results.append(result)
        except Exception:
            self.scheduler.abort_requests(added)
            for seq_id in added:
                self._requests.pop(seq_id, None)
            raise
        return results

    def _image_prompts(self) -> ImagePrompts:
        """The checkpoint's image processor, read at the first prompt with images."""
        if self._images is None:
            model = image_model(self.model_path)
            if model is None:
                raise ValueError(no_images_why(self.model_path))
            self._images = ImagePrompts(self.model_path, model)
        return self._images

    def _loras(self, lora_request, count: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each read here first: a bad adapter is the
        caller's ValueError, before anything is queued."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * count
        else:
            loras = list(lora_request)
            if len(loras) != count:
                raise ValueError(f"{count} prompts but {len(loras)} LoRA requests")
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            if not isinstance(lora, LoRARequest):
                raise TypeError(f"expected LoRARequest, got {type(lora).__name__}")
            if self.runner.loras is None:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but this LLM was made without "
                                 "enable_lora=True")
            self.executor.call(self.runner.loras.prepare, lora)
        return loras


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind == RequestOutputKind.FINAL_ONLY or not isinstance(params, SamplingParams):
        return params  # (a wrong type is add_requests' TypeError)
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
