"""The offline API: scheduler and model runner wired together in one process.

`LLM.step()` is the whole engine: schedule, execute, update, detokenize. The services
run the very same two objects with a bus in between.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from tqdm import tqdm

from llmbus.model_fetch import resolve_model
from llmbus.outputs import CompletionOutput, RequestOutput
from services.scheduler.scheduler import Scheduler
from services.tokenizer.tokenizer import Tokenizer
from services.worker.model_config import ModelConfig
from services.worker.model_runner import ModelRunner
from shared.config import CacheConfig, SchedulerConfig
from shared.detokenizer import IncrementalDetokenizer
from shared.messages import EngineCoreRequest, FinishReason, SchedulerStats
from shared.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass(slots=True)
class _Sequence:
    """One engine request: a prompt's n-th sample, with its detokenizer."""

    request_id: str
    parent: RequestOutput
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        quantization: str | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int = 1 << 30,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        attention_backend: str | None = None,
        threads: int | None = None,
    ) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        path = resolve_model(model)
        ModelConfig.from_folder(path)  # an unsupported model fails here, before anything loads
        cache_config = CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            cache_dtype=kv_cache_dtype,
        )
        self.tokenizer = Tokenizer(path)
        self.runner = ModelRunner(
            path, cache_config, dtype=dtype, quantization=quantization, attention_backend=attention_backend,
            max_model_len=max_model_len,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=self.runner.max_model_len,
                long_prefill_token_threshold=long_prefill_token_threshold,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            num_kv_blocks=self.runner.num_blocks,
            block_size=block_size,
            vocab_size=self.runner.vocab_size,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.eos_token_id = self.tokenizer.eos_token_id
        self._ids = itertools.count()
        self._sequences: dict[str, _Sequence] = {}

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    # ---- public API -------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        results = self.add_requests(prompts, params_list)
        pending = {seq_id for r in results for seq_id in self._children(r)}
        with tqdm(total=len(pending), disable=not use_tqdm, desc="generate", unit="req") as bar:
            while pending:
                for done in self.step():
                    if done in pending:
                        pending.discard(done)
                        bar.update()
            self.step()  # lets the worker drop the state of the requests that just finished
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            for conv in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- the engine -------------------------------------------------------------------

    def step(self) -> list[str]:
        """One engine step; returns the ids of sequences that finished in it."""
        if not self.scheduler.has_work():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        finished = []
        for outputs in self.scheduler.update_from_output(scheduler_output, runner_output).values():
            for out in outputs.outputs:
                seq = self._sequences.get(out.request_id)
                if seq is None:
                    continue
                completion = seq.output
                completion.token_ids.extend(out.new_token_ids)
                if seq.want_logprobs:
                    completion.logprobs.extend(out.new_logprobs)
                seq.parent.num_cached_tokens = out.num_cached_tokens
                stop_string = seq.detokenizer.update(out.new_token_ids)
                if stop_string is not None and out.finish_reason is None:
                    self.scheduler.abort_requests([out.request_id])
                    out.finish_reason, out.stop_reason = FinishReason.STOP, stop_string
                if out.finish_reason is not None:
                    self._finish(seq, out.finish_reason, out.stop_reason, out.error)
                    finished.append(out.request_id)
        return finished

    def _finish(self, seq: _Sequence, reason: FinishReason, stop_reason, error) -> None:
        completion = seq.output
        seq.detokenizer.flush()
        completion.finish_reason = str(reason)
        completion.stop_reason = seq.detokenizer.stop_string or stop_reason
        completion.text = seq.detokenizer.output_text
        if error is not None:
            raise RuntimeError(f"request {seq.request_id} failed in the engine: {error}")
        del self._sequences[seq.request_id]
        seq.parent.finished = all(o.finish_reason is not None for o in seq.parent.outputs)

    def _children(self, result: RequestOutput) -> list[str]:
        return [f"{result.request_id}-{o.index}" for o in result.outputs]

    def add_requests(self, prompts: list[Prompt], params_list: list[SamplingParams]) -> list[RequestOutput]:
        """Queue without running (drive the engine with `step()`; `generate` does both).
        Everything is validated first: on any error nothing is left queued."""
        encoded = []
        for prompt, params in zip(prompts, params_list):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
            if isinstance(prompt, str):
                encoded.append((prompt, self.tokenizer.encode(prompt)))
            else:
                encoded.append((None, list(prompt)))
        added: list[str] = []
        results = []
        try:
            for (text, token_ids), params in zip(encoded, params_list):
                result = RequestOutput(str(next(self._ids)), text, token_ids)
                for index in range(params.n):
                    seq_id = f"{result.request_id}-{index}"
                    child_params = params
                    if params.n > 1 and params.seed is not None:
                        # n samples with one seed would all be the same sample.
                        child_params = msgspec.structs.replace(params, seed=params.seed + index)
                    self.scheduler.add_request(
                        EngineCoreRequest(
                            request_id=seq_id,
                            prompt_token_ids=token_ids,
                            sampling_params=child_params,
                            eos_token_id=self.eos_token_id,
                            arrival_time=time.time(),
                        )
                    )
                    added.append(seq_id)
                    completion = CompletionOutput(
                        index=index, text="", token_ids=[], finish_reason=None,
                        logprobs=[] if params.logprobs is not None else None,
                    )
                    result.outputs.append(completion)
                    self._sequences[seq_id] = _Sequence(
                        seq_id,
                        result,
                        completion,
                        IncrementalDetokenizer(
                            self.tokenizer.backend, token_ids, params.skip_special_tokens, params.stop
                        ),
                        params.logprobs is not None,
                    )
                results.append(result)
        except Exception:
            self.scheduler.abort_requests(added)
            for seq_id in added:
                self._sequences.pop(seq_id, None)
            raise
        return results
