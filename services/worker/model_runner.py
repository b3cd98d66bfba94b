"""The model runner core: applies a `SchedulerOutput`, runs one forward, samples.

It holds the model, the paged KV cache and the state of every request it serves; the
scheduler sends full data only for requests new to it and deltas for the rest. It orders
each step's work (inputs: step_inputs.py; sampling: sample/; KV sizing: kv_cache.py) and
knows nothing of transport. A step is launched (forward and sampling queued on the device)
and finished (its tokens on the host) apart, so the next step can be launched in between
and read those tokens on the device (launched_step.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import os
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from services.worker.attention.backend import get_attention_backend
from services.worker.attention.kv_cache_dtype import cache_dtype
from services.worker.block_table import BlockTable
from services.worker.decode_graphs import DecodeGraphs
from services.worker.host_values import to_device
from services.worker.device_tokens import read_device_tokens
from services.worker.launched_step import LaunchedStep, reads_device_tokens_only
from services.worker.loader import load_model, parse_dtype, resolve_dtype
from services.worker.lora.manager import LoRAManager, adapter_or_why
from services.worker.kv_tier import host_kv_tier, load_for_step
from services.worker.kv_cache import allocate_kv_caches, size_kv_cache
from services.worker.models.decoder_config import ModelConfig
from services.worker.models.quantization import choose_quantization
from services.worker.parallel.group import current_group
from services.worker.parallel.sharding import local_config
from services.worker.pooling import EMBED_PLACEHOLDER, pool
from services.worker.vision.encoder import image_encoder, image_refusal
from services.worker import recurrent_state
from services.worker.step_log import StepLog
from services.worker.request_state import RequestState
from services.worker.sample.sampler import Sampler
from services.worker.sample.acceptance import accept
from services.worker.sample.spec_decode import logit_rows, make_proposer, propose_drafts
from services.worker.step_inputs import StepInputs
from services.worker.sample import grammar, prompt_logprobs
from shared.structured_output import GrammarBackend
from shared.config import CacheConfig, WorkerConfig
from shared.messages import ModelRunnerOutput, SchedulerOutput, WorkerInfo

_ARGMAX_ONLY = operator.attrgetter("argmax_only")
_NUM_COMPUTED, _REQ_ID = operator.attrgetter("num_computed_tokens"), operator.attrgetter("req_id")

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_path: str | Path, config: WorkerConfig | None = None, **fields) -> None:
        """`fields`: WorkerConfig's, over `config` (or its defaults)."""
        self.config = config = dataclasses.replace(config or WorkerConfig(), **fields)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = resolve_dtype(config.dtype, model_path, self.device)  # ("auto": the checkpoint's)
        self.tp = current_group()  # a tensor-parallel rank's group (parallel/), or None
        full_config = ModelConfig.from_folder(model_path)
        self.model_config = full_config if self.tp is None else local_config(
            full_config, self.tp.world_size, self.tp.rank if config.enable_expert_parallel else None)
        quantization = choose_quantization(config.quantization, self.model_config.quantized_weights, dtype,
                                           self.device, model_path)
        self.quantization = quantization
        # Triton kernels on a GPU; plain PyTorch on the CPU (Triton there only interprets).
        attention_backend = config.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.cache_config = config.cache_config or CacheConfig()
        self.max_model_len = min(self.model_config.max_model_len, config.max_model_len or 1 << 62)
        self.dtype = parse_dtype(dtype)
        self.kv_cache_dtype = cache_dtype(self.cache_config.cache_dtype, self.dtype)
        self.block_size = self.cache_config.block_size
        backend = get_attention_backend(attention_backend)
        self.model = load_model(model_path, self.model_config, self.dtype, backend, self.max_model_len, quantization,
                                self.device, config.load_format, self.tp and (self.tp, full_config))
        self.images = image_encoder(model_path, self.dtype, self.device, config, self.model)  # (or None)
        # Latent attention caches one latent a token, read as its keys and its values: one
        # memory for both (layers/latent_attention.py)
        self.values_are_keys = bool(self.model_config.kv_lora_rank)
        # A hybrid's recurrent layers (linear attention, short convolutions, Mamba2) keep a
        # state a request in place of KV blocks (layers/gated_delta_net.py, short_conv.py,
        # mamba2.py): a row for each request it may hold at once, found by the request's
        # block-table row, and one more, where a decode graph's pads write.
        self.recurrent_rows = config.max_num_seqs if self.model_config.recurrent_layers else 0
        # With prefix caching, up to as many rows again of snapshots (as the budget allows:
        # size_kv_cache), past the pad row: a request's state at a cached block's end
        # (services/scheduler/core/state_snapshots.py).
        self.snapshot_rows = self.recurrent_rows if self.cache_config.enable_prefix_caching else 0
        self.proposer = make_proposer(config, self.model_config, self.dtype, backend,
                                      self.max_model_len, self.device, self.tp, self.model, model_path, quantization)
        self.num_blocks, self.recurrent_rows, self.snapshot_rows = size_kv_cache(
            self.model_config, self.cache_config, self.block_size, self.kv_cache_dtype, self.values_are_keys,
            self.device, self.recurrent_rows, self.snapshot_rows,
            lambda rows: recurrent_state.state_bytes(self.model, self.model_config.recurrent_layers, rows, self.dtype),
            getattr(self.proposer, "bytes_per_block", lambda *_: 0)(self.block_size, self.kv_cache_dtype))
        if self.tp is not None:  # (every rank holds the same block ids: as many as the least of them)
            self.num_blocks = self.tp.min(self.num_blocks)
        lora_config = config.lora_config
        self.loras = LoRAManager(self.model, lora_config, self.dtype, self.device) if lora_config else None
        # Requests that failed as they arrived (their adapter could not be read): id -> why
        self._arrival_errors: dict[str, str] = {}
        # One block more than the scheduler knows: the pad block, for a decode graph's pads (decode_graphs.py)
        self.pad_block = self.num_blocks
        self.kv_caches = allocate_kv_caches(
            self.model_config, backend, self.num_blocks + 1, self.block_size, self.kv_cache_dtype, self.values_are_keys,
            self.device, lambda i: recurrent_state.state_shapes(self.model, i, self.recurrent_rows + self.snapshot_rows,
                                                               self.dtype))
        if hasattr(self.proposer, "allocate"):  # (a drafter's blocks: the same ids, the pad block's too)
            self.proposer.allocate(self.num_blocks + 1, self.block_size, self.kv_cache_dtype)
        self.kv_tier = host_kv_tier(self.kv_caches, self.cache_config, self.recurrent_rows > 0,
                                    self.model_config.architecture, config.kv_role)
        self.max_cudagraph_capture_size = config.max_cudagraph_capture_size
        # CUDA graphs for decode steps on a GPU unless --enforce-eager; eager on CPU, where a
        # step's launches cost little beside its products (and the fused decode layer's).
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and self.tp is None:  # (TP: to measure)
            self.set_decode_graphs("capture")
        self.requests: dict[str, RequestState] = {}
        # (+1: a step's blocks may reach one past max_model_len's, for the token it samples.)
        self.block_table = BlockTable(-(-self.max_model_len // self.block_size) + 1)
        self.sampler = Sampler(config.seed)
        self.grammars = GrammarBackend(config.tokenizer or model_path, self.vocab_size)
        # Wall-clock ns of the last step's phases: start, forward, sampling, end (for tracing).
        self.last_step_ns: tuple[int, int, int, int] = (0, 0, 0, 0)
        # Steps launched whose tokens are not on the host yet (see launch), oldest first.
        # Overlapping pays only where the device runs apart from the host: on a CPU a
        # step's work is done by the time launch returns (W1 bf16 measured 0.98x of
        # finishing each step at once, 3 pairs), so there each step is finished as launched.
        # LLMBUS_OVERLAP_STEPS=1 or 0 says otherwise (tests overlap a served CPU worker).
        self._launched: deque[LaunchedStep] = deque()
        overlap = os.environ.get("LLMBUS_OVERLAP_STEPS")
        self.overlap_steps = self.device.type == "cuda" if overlap is None else overlap == "1"
        self._step_log = StepLog.from_env()
        log.info("model loaded", extra={"model": str(model_path), "dtype": dtype, "quantization": quantization,
                                        "kv_blocks": self.num_blocks})

    def set_decode_graphs(self, mode: str | None) -> None:
        """Decode steps from persistent buffers: "capture" (CUDA graphs), "replay" (the same
        buffers run eagerly, on any device: what tests use on CPU), or None (eager)."""
        self.decode_graphs = None
        if mode is None:
            return
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, mode=mode, max_size=self.max_cudagraph_capture_size,
            max_model_len=self.max_model_len, block_size=self.block_size, pad_block=self.pad_block,
            hidden_size=self.model_config.hidden_size, dtype=self.dtype, device=self.device,
            pad_state_row=self.recurrent_rows,
        )
        if mode == "capture":
            try:
                with torch.inference_mode():
                    self.decode_graphs.capture_all()
            except RuntimeError as exc:  # a forward that reads the device on the host: eager it is
                # (with the traceback: on a GPU lease the log is all there is to find the call by)
                log.warning("decode steps run eager: CUDA graph capture failed (%s)", exc, exc_info=True)
                self.decode_graphs = None

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def describe(self, worker_id: str = "", model: str = "", incarnation: int = 0) -> WorkerInfo:
        """What a scheduler needs to know of this runner (Scheduler.for_worker), as a worker
        announces it on the bus."""
        lora, tier = self.config.lora_config, self.kv_tier
        return WorkerInfo(
            worker_id=worker_id, model=model, num_kv_blocks=self.num_blocks, block_size=self.block_size,
            max_model_len=self.max_model_len, vocab_size=self.vocab_size, eos_token_id=self.model_config.eos_token_id,
            incarnation=incarnation, long_rope_threshold=self.model_config.long_rope_threshold,
            generates=self.model.generates, max_loras=lora.max_loras if lora else 0,
            max_lora_rank=lora.max_lora_rank if lora else 0, recurrent_rows=self.recurrent_rows,
            recurrent_snapshot_rows=self.snapshot_rows, kv_tier=tier.name if tier else "",
            kv_tier_slots=tier.num_slots if tier else 0, kv_tier_disk_slots=tier.num_disk_slots if tier else 0,
            kv_role=self.config.kv_role, tensor_parallel_size=self.config.tensor_parallel_size)

    def drop_requests(self, req_ids) -> None:
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.block_table.free(state.block_row)
                self.sampler.penalty_counts.free(state)

    # ---- one step -------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to end: its sampled tokens on the host when it returns."""
        return self.launch(scheduler_output).finish()

    def finish_launched(self) -> None:
        """Land every launched step's tokens on the host (in launch order)."""
        while self._launched:
            self._launched[0].finish()

    def _retire(self, step: LaunchedStep) -> None:
        """A launched step is finishing: those launched before it finish first."""
        while self._launched and self._launched[0] is not step:
            self._launched[0].finish()
        if self._launched:
            self._launched.popleft()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue one step's forward and sampling; its tokens reach the host at `finish()`.
        A step that reads tokens the device still holds on the host (grammars and drafts
        read a request's history there) first finishes the steps launched before it
        (launched_step.reads_device_tokens_only); so does one with a request whose grammar
        is live, or that verifies drafts, whose acceptance runs on the host at once."""
        t_start = time.time_ns()
        behind = len(self._launched)  # steps launched whose tokens are not on the host yet
        self._update_states(scheduler_output)
        num_scheduled = scheduler_output.num_scheduled_tokens
        arrival_errors, self._arrival_errors = self._arrival_errors, {}
        # (blocks of prefixes from the host's KV tier, before anything reads them)
        bad_blocks, load_failures = load_for_step(self.kv_tier, scheduler_output, functools.partial(
            self._unschedule, scheduler_output)) if scheduler_output.kv_loads or scheduler_output.kv_remote_loads \
            else ((), ())
        if scheduler_output.state_restores:  # a hybrid's prefix hits: their state, before the forward
            recurrent_state.copy_states(self.kv_caches, self.model_config.recurrent_layers, self.requests,
                                        scheduler_output.state_restores, self.recurrent_rows, self.device, False)
        if not num_scheduled:
            if scheduler_output.kv_stores:  # (a worker leaving: the last blocks of the requests it hands over)
                self.kv_tier.store(scheduler_output.kv_stores, scheduler_output.kv_tier_moves)
            return LaunchedStep.done(ModelRunnerOutput(
                step_id=scheduler_output.step_id, req_ids=[], sampled_token_ids=[], request_errors=arrival_errors,
                kv_bad_blocks=list(bad_blocks), kv_load_failures=list(load_failures)))
        if self._launched and not reads_device_tokens_only(self.requests, scheduler_output):
            self.finish_launched()
        # Speculation: drafts for the requests given slots; each computes its scheduled
        # tokens less the slots its drafts leave unused.
        drafts = propose_drafts(self.proposer, self.requests, scheduler_output.num_draft_slots,
                                self.model_config.long_rope_threshold, self.block_size, self.block_table, self.sampler)
        num_tokens = {
            rid: n - scheduler_output.num_draft_slots.get(rid, 0) + len(drafts.get(rid, ()))
            for rid, n in num_scheduled.items()
        } if scheduler_output.num_draft_slots else num_scheduled  # (read only, below)

        # Decodes (one new token) first, shortest context first, so attention can batch
        # them in groups of similar length.
        requests = self.requests
        if not drafts and len(num_tokens) == sum(num_tokens.values()):  # decodes only (C-level sort key)
            states = sorted(map(requests.__getitem__, num_tokens), key=_NUM_COMPUTED)
            order = list(map(_REQ_ID, states))
        else:  # (a request verifying drafts is decodes too: one row per token, see StepInputs.build)
            order = sorted(num_tokens, key=lambda rid: (num_tokens[rid] != 1 and rid not in drafts,
                                                        requests[rid].num_computed_tokens))
            states = [requests[rid] for rid in order]
        long_offset = self.model.model.rotary.long_offset if self.model_config.long_rope_threshold is not None else None
        fed_back = self._launched[-1].fed_back(states) if self._launched and not drafts else None
        inputs, sample_rows, last_token, from_device = StepInputs.build(states, num_tokens, drafts, self.block_size,
                                                                        self.block_table, long_offset, fed_back)
        if self.loras is not None:  # each request's tokens: from the one after the last's to its last
            self.loras.map_step([s.lora for s in states], np.concatenate(([0], last_token[:-1] + 1)),
                                last_token + 1)

        images = self.images and self.images.for_step(states, num_tokens, drafts, inputs.positions)  # (or None)
        t_forward = time.time_ns()
        graphs = self.decode_graphs
        on_graph = graphs is not None and not self.model.eager_only and graphs.takes(inputs) and images is None
        patch = (lambda ids: read_device_tokens(ids, from_device)) if len(from_device) else None
        if on_graph:
            hidden = graphs.run(inputs, patch)
        else:
            input_ids, positions, metadata = inputs.to_device(self.device)
            if patch is not None:
                patch(input_ids)
            hidden = self.model(input_ids, positions, self.kv_caches, metadata, images)
        if hasattr(self.proposer, "saw_step"):  # (an MTP layer or EAGLE-3 head reads the step's hidden states)
            self.proposer.saw_step(hidden, states, num_tokens)
        if scheduler_output.kv_stores:  # blocks this forward filled, to the host's tier
            self.kv_tier.store(scheduler_output.kv_stores, scheduler_output.kv_tier_moves)
        if scheduler_output.state_saves:  # the state at a block's end, for later prefix hits
            recurrent_state.copy_states(self.kv_caches, self.model_config.recurrent_layers, self.requests,
                                        scheduler_output.state_saves, self.recurrent_rows, self.device, True)
        t_sample = time.time_ns()
        sampled: list[list[int]] = [[] for _ in order]
        logprobs: list[list] = [[] for _ in order]
        output = ModelRunnerOutput(
            step_id=scheduler_output.step_id, req_ids=order, sampled_token_ids=sampled, logprobs=logprobs,
            num_draft_tokens=[len(drafts.get(rid, ())) for rid in order] if drafts else [],
            request_errors=arrival_errors, kv_bad_blocks=list(bad_blocks), kv_load_failures=list(load_failures),
        )
        launched = LaunchedStep.done(output)
        mask_ns = 0  # the grammars' share of sampling (the step log reports it)
        # Most decode steps: every request samples the argmax, nothing else asked of it, so
        # none of the per-request passes below for grammars, prompt logprobs, embeddings,
        # the sampler's processing and logprobs has anything to find.
        argmax_only = not drafts and all(map(_ARGMAX_ONLY, states))
        constrained = [] if argmax_only else [i for i in sample_rows if states[i].matcher is not None]
        if any(isinstance(states[i].matcher, Future) for i in constrained):
            # (a tensor-parallel rank waits for every compile: the ranks must sample the same rows)
            sample_rows, pending, failed = grammar.split_ready(states, sample_rows, None if self.tp else grammar.wait_s(
                states, sample_rows, self.recurrent_rows > 0))
            output.resample_req_ids = [order[i] for i in pending]
            output.request_errors.update({order[i]: why for i, why in failed.items()})
            self.drop_requests([order[i] for i in failed])
            constrained = [i for i in sample_rows if states[i].matcher is not None]
        if not argmax_only and any(s.prompt_logprobs is not None for s in states):  # (mostly none)
            sample_rows = prompt_logprobs.add_step(self.model, states, num_tokens, last_token, hidden, sample_rows,
                                                   output, self.drop_requests)
            constrained = [i for i in sample_rows if states[i].matcher is not None]
        embeds = [] if argmax_only else [i for i in sample_rows if states[i].sampling_params.embed]  # (mostly none)
        if embeds:
            vectors = pool(self.model, hidden, to_device(last_token[embeds], self.device))
            output.pooled = {order[i]: vector for i, vector in zip(embeds, vectors)}
            for i in embeds:
                states[i].token_ids.append(EMBED_PLACEHOLDER)
                sampled[i] = [EMBED_PLACEHOLDER]
            sample_rows = [i for i in sample_rows if not states[i].sampling_params.embed]
            constrained = [i for i in sample_rows if states[i].matcher is not None]
        if sample_rows:
            rows, row_states, first_row = logit_rows(sample_rows, states, order, drafts, last_token)
            # A decode step's every token samples, in order: its hidden states as they are.
            selected = hidden if len(rows) == len(hidden) else hidden[to_device(rows, self.device)]
            logits = self.model.compute_logits(selected)
            # The grammar at every sampled position, drafts included. A terminated matcher
            # (it took the stop token) belongs to a request the scheduler has ended: this row
            # was in flight, and its token will be dropped there.
            jobs = [(first, states[i].matcher, drafts.get(order[i], [])) for i, first in zip(sample_rows, first_row)
                    if states[i].matcher is not None and not states[i].matcher.is_terminated()] if constrained else []
            valid = {}
            if jobs:
                t_mask = time.perf_counter_ns()
                plain = frozenset(r for r, st in enumerate(row_states) if grammar.plain_greedy(st))
                valid = dict(zip((job[0] for job in jobs), grammar.mask(logits, jobs, self.grammars.vocab_size, plain)))
                mask_ns = time.perf_counter_ns() - t_mask
            samples = self.sampler.argmax(logits) if argmax_only else self.sampler.sample(logits, row_states)
            if drafts or constrained or not self.overlap_steps:
                # Tokens land in order: those of steps launched before this one first.
                self.finish_launched()
                accept(samples, states, sample_rows, first_row, drafts, valid, order, sampled, logprobs,
                       bool(constrained), getattr(self.proposer, "synthetic", None))
            else:
                # The tokens stay on the device; the next step reads them there.
                samples.start_copy()
                sampled_states, ids = [], samples.ids
                for i, row in zip(sample_rows, first_row):
                    state = states[i]
                    state.num_pending += 1
                    state.pending_token = (ids, row)
                    sampled_states.append((i, row, state))
                in_order = states if len(sample_rows) == len(states) else None  # (no drafts here: row i is states[i])
                launched = LaunchedStep(output, samples, sampled_states, on_finish=self._retire, in_order=in_order)
                self._launched.append(launched)
        if launched.finished and not any(logprobs):  # (a launched step's finish() says so itself)
            output.logprobs = []
        for state in states:
            state.num_computed_tokens += num_tokens[state.req_id]
        self.last_step_ns = (t_start, t_forward, t_sample, time.time_ns())
        if self._step_log is not None:
            self._step_log.write(self.last_step_ns, inputs, on_graph, len(sample_rows), mask_ns, drafts, sampled, order,
                                 behind)
        return launched

    def _unschedule(self, so: SchedulerOutput, req_id: str) -> None:
        """A request out of this step and this worker (it failed as it arrived, or read a
        tier block that failed its checksum); the scheduler hears why."""
        self.drop_requests([req_id])
        so.num_scheduled_tokens.pop(req_id, None)
        so.num_draft_slots.pop(req_id, None)

    def _update_states(self, so: SchedulerOutput) -> None:
        if so.reset:
            self.drop_requests(list(self.requests))
        self.drop_requests(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            spec = new.sampling_params.structured_outputs
            self.drop_requests([new.req_id])  # (sent again whole: resumed or preempted)
            refusal = recurrent_state.refusal(
                new, so.state_restores.get(new.req_id), self.recurrent_rows, self.snapshot_rows,
                self.block_table.num_rows_in_use, self.model_config.architecture) if self.recurrent_rows else None
            adapter = refusal or image_refusal(new, self.images) or (
                adapter_or_why(self.loras, new.lora_request) if new.lora_request is not None else None)
            if isinstance(adapter, str):  # it fails alone; the step goes on without it
                self._arrival_errors[new.req_id] = adapter
                self._unschedule(so, new.req_id)
                continue
            # New to this worker (first step, resumed, preempted, migrated): a fresh matcher,
            # with the tokens already generated replayed into it.
            matcher = self.grammars.start_matcher(spec, new.output_token_ids) if spec is not None else None
            self.requests[new.req_id] = RequestState.of_new(new, self.block_table.add(new.block_ids), matcher,
                                                            self.model_config.long_rope_threshold, adapter)
        cached = so.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                       cached.num_computed_tokens):
            state = self.requests.get(req_id)
            if state is None:
                # Dropped after a failed step while this one was already in flight (async
                # scheduling): the scheduler has ended it and ignores its absence here.
                so.num_scheduled_tokens.pop(req_id, None)
                continue
            if new_block_ids:  # (a decode step: mostly none)
                self.block_table.append(state.block_row, new_block_ids)
            state.num_computed_tokens = num_computed
