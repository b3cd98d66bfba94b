"""The model runner core: applies a `SchedulerOutput`, runs one forward, samples.

It holds the model, the paged KV cache and the state of every request it serves; the
scheduler sends full data only for requests new to it and deltas for the rest. It turns
those requests into flat tensors (token ids, positions, query_start_loc, seq_lens,
slot_mapping, block_table) and knows nothing of transport. A step is launched (forward
and sampling queued on the device) and finished (its tokens on the host) apart, so the
next step can be launched in between and read those tokens on the device
(launched_step.py).
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from services.worker.attention.backend import get_attention_backend
from services.worker.attention.kv_cache_dtype import cache_dtype
from services.worker.block_table import BlockTable
from services.worker.decode_graphs import DecodeGraphs
from services.worker.host_values import to_device
from services.worker.device_tokens import read_device_tokens
from services.worker.launched_step import LaunchedStep, reads_device_tokens_only
from services.worker.layers.quantized_linear import QUANTIZATIONS
from services.worker.loader import load_model, parse_dtype, resolve_dtype
from services.worker.lora.adapter import LoRAAdapter
from services.worker.lora.manager import LoRAManager
from services.worker.memory import check_kv_cache_fits, kv_cache_budget
from services.worker.models.decoder_config import ModelConfig
from services.worker.sample.prompt_logprobs import add_chunk
from services.worker.request_state import RequestState
from services.worker.sample.sampler import Sampler
from services.worker.sample.spec_decode import DraftPosition, NgramProposer, num_accepted
from services.worker.step_inputs import StepInputs
from services.worker.sample import grammar
from services.worker.sample.grammar import plain_greedy, split_ready
from shared.structured_output import GrammarBackend
from shared.config import CacheConfig, LoRAConfig, SpeculativeConfig
from shared.messages import ModelRunnerOutput, SchedulerOutput

# How long a step with only grammar-waiting requests waits for a compile (see split_ready).
GRAMMAR_WAIT_S = 0.05

# The token an embedding request ends with (it samples nothing): any id the vocabulary has.
EMBED_PLACEHOLDER = 0
_ARGMAX_ONLY = operator.attrgetter("argmax_only")
_NUM_COMPUTED, _REQ_ID = operator.attrgetter("num_computed_tokens"), operator.attrgetter("req_id")

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_path: str | Path,
        cache_config: CacheConfig | None = None,
        dtype: str = "float32",
        attention_backend: str | None = None,
        max_model_len: int | None = None,
        device: str | None = None,
        quantization: str | None = None,
        speculative_config: SpeculativeConfig | None = None,
        *,
        enforce_eager: bool = False,
        max_cudagraph_capture_size: int = 256,
        load_format: str = "auto",
        lora_config: LoRAConfig | None = None,  # --enable-lora: serve LoRA adapters
        seed: int | None = None,  # vLLM's --seed: unseeded requests' draws repeat from run to run
        tokenizer: str | None = None,  # vLLM's --tokenizer: where grammars read the vocabulary (default: the model)
        max_num_seqs: int = 128,  # vLLM's: a hybrid model's recurrent state is allocated for this many requests
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = resolve_dtype(dtype, model_path, self.device)  # ("auto": the checkpoint's)
        self.model_config = ModelConfig.from_folder(model_path)
        held = self.model_config.quantized_weights
        # int4 on a GPU: the Triton kernel, in 16-bit activations (kernels/linear_int4.py)
        int4_dtypes = ("bfloat16",) if self.device.type == "cpu" else ("bfloat16", "float16")
        if quantization is None and held is not None and held.bits == 4 and not held.reordered \
                and dtype in int4_dtypes:
            # A 4-bit checkpoint (AWQ, W4A16, GPTQ) stays at 4 bits, as vLLM serves it:
            # int4_grid finds its levels again in each group of 32 inputs (the offsets rounded
            # to float16, within a hundredth of a level). Elsewhere (float32, GPTQ's reordered
            # groups, which no run of 32 inputs keeps) it runs widened.
            quantization = "int4"
        elif quantization is None and held is not None and held.bits == 8 and held.int_per_channel \
                and not held.zero_points and dtype == "bfloat16" and self.device.type == "cpu":
            # A symmetric int8 checkpoint with a scale an output channel (W8A8 INT8, W8A16)
            # stays at 8 bits on a CPU, as vLLM's CPU backend serves W8A8: the int8 layers'
            # grid (int8_grid) finds its levels and scales again, exactly.
            quantization = "int8"
        elif quantization is None and held is not None and dtype == "float32":
            log.warning("quantized checkpoint widened to float32 (four bytes a weight): --dtype bfloat16 or auto "
                        "serves it at its own precision's size or near it", extra={"model": str(model_path)})
        if quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"unknown quantization {quantization!r}: {', '.join(QUANTIZATIONS)}")
        if quantization == "int8" and self.device.type != "cpu":
            raise ValueError("--quantization int8 runs on CPU (its kernels are CPU ones)")
        if quantization is not None and dtype not in int4_dtypes:
            # int8's kernel takes bfloat16 only; int4's float32 path is a slow reference
            # (measured: a decode step 127 ms, against 60 ms unquantized in float32).
            raise ValueError(f"--quantization {quantization} runs with --dtype {' or '.join(int4_dtypes)}")
        self.quantization = quantization
        # Triton kernels on a GPU; plain PyTorch on the CPU (Triton there only interprets).
        attention_backend = attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.cache_config = cache_config or CacheConfig()
        self.max_model_len = min(self.model_config.max_model_len, max_model_len or 1 << 62)
        self.dtype = parse_dtype(dtype)
        self.kv_cache_dtype = cache_dtype(self.cache_config.cache_dtype, self.dtype)
        self.block_size = self.cache_config.block_size
        backend = get_attention_backend(attention_backend)
        self.model = load_model(model_path, self.model_config, self.dtype, backend, self.max_model_len, quantization,
                                self.device, load_format)
        # Latent attention caches one latent a token, read as its keys and its values: one
        # memory for both (layers/latent_attention.py)
        self.values_are_keys = bool(self.model_config.kv_lora_rank)
        # A hybrid's recurrent layers (linear attention, short convolutions, Mamba2) keep a
        # state a request in place of KV blocks (layers/gated_delta_net.py, short_conv.py,
        # mamba2.py): a row for each request it may hold at once, found by the request's
        # block-table row, and one more, where a decode graph's pads write.
        self.recurrent_rows = max_num_seqs if self.model_config.recurrent_layers else 0
        # With prefix caching, up to as many rows again of snapshots (as the budget allows:
        # _num_kv_blocks), past the pad row: a request's state at a cached block's end
        # (services/scheduler/core/state_snapshots.py).
        self.snapshot_rows = self.recurrent_rows if self.cache_config.enable_prefix_caching else 0
        if self.recurrent_rows and speculative_config is not None:
            raise ValueError(f"speculative decoding is not supported for {self.model_config.architecture}: its "
                             "recurrent layers' state cannot take back rejected drafts")
        self.num_blocks = self._num_kv_blocks()
        self.loras = LoRAManager(self.model, lora_config, self.dtype, self.device) if lora_config else None
        # Requests that failed as they arrived (their adapter could not be read): request
        # id -> why, sent with the step's output.
        self._arrival_errors: dict[str, str] = {}
        cfg = self.model_config
        # One block more than the scheduler is told of: the pad block, where the padded
        # rows of a decode graph write (decode_graphs.py), never a request's.
        self.pad_block = self.num_blocks
        self.kv_caches = [
            backend.new_kv_cache(
                self.num_blocks + 1, self.block_size, cfg.num_key_value_heads, cfg.head_dim, self.kv_cache_dtype,
                self.device, values_are_keys=self.values_are_keys,
            )  # [2 (K, V), num_blocks + 1, block_size, num_kv_heads, head_dim]
            if i in cfg.attention_layers else
            tuple(torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in self._state_shapes(i))
            if i in cfg.recurrent_layers else None  # (a layer without a token mixer: Nemotron-H's MLP blocks)
            for i in range(cfg.num_hidden_layers)
        ]
        self.max_cudagraph_capture_size = max_cudagraph_capture_size
        # CUDA graphs for decode steps on a GPU unless --enforce-eager; eager on CPU, where
        # a step's launches cost little beside its products (and the fused decode layer
        # already makes one call a layer).
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not enforce_eager:
            self.set_decode_graphs("capture")
        self.requests: dict[str, RequestState] = {}
        # (+1: a step's blocks may reach one past max_model_len's, for the token it samples.)
        self.block_table = BlockTable(-(-self.max_model_len // self.block_size) + 1)
        self.sampler = Sampler(seed)
        self.grammars = GrammarBackend(tokenizer or model_path, self.vocab_size)
        self.proposer = NgramProposer(speculative_config) if speculative_config is not None else None
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
        # LLMBUS_STEP_LOG=FILE: one JSON line per step (phase times and batch shape), to
        # compare what the worker does offline and served without a tracing backend.
        step_log = os.environ.get("LLMBUS_STEP_LOG")
        self._step_log = open(step_log, "a", buffering=1) if step_log else None
        log.info(
            "model loaded",
            extra={"model": str(model_path), "dtype": dtype, "quantization": quantization,
                   "kv_blocks": self.num_blocks},
        )

    def _num_kv_blocks(self) -> int:
        """The scheduler's blocks: --num-kv-blocks, or as many as the budget holds
        (memory.kv_cache_budget: --kv-cache-memory-gb, or --gpu-memory-utilization's share on
        a GPU); refused (before any is allocated) where they and the pad block do not fit."""
        cfg = self.model_config
        bytes_per_block = (
            (1 if self.values_are_keys else 2) * len(cfg.attention_layers) * self.block_size * cfg.num_key_value_heads
            * cfg.head_dim * self.kv_cache_dtype.itemsize
        )
        # A hybrid's recurrent state comes out of the same budget (vLLM counts it so)
        cc = self.cache_config
        if cc.num_kv_blocks is not None:
            num_blocks, asked = cc.num_kv_blocks, f"--num-kv-blocks {cc.num_kv_blocks}"
            state_bytes = self._state_bytes()
        else:
            budget, asked = kv_cache_budget(cc.kv_cache_memory_bytes, cc.gpu_memory_utilization, self.device)
            row_bytes = self._state_bytes(1) - self._state_bytes(0)
            if row_bytes and (self.recurrent_rows + 1) * row_bytes > budget // 2:
                # A hybrid's state a request is that of hundreds of tokens' KV (Qwen3.5-0.8B:
                # 19 MiB): --max-num-seqs of them would leave a default budget no blocks. Its
                # rows then take at most half of the budget, and so many requests run at once.
                rows = max(1, budget // 2 // row_bytes - 1)
                log.warning("the recurrent state of %d requests (%.2f GiB) would take over half the KV cache's "
                            "budget (%s): %d requests run at once (raise the budget for more)",
                            self.recurrent_rows, (self.recurrent_rows + 1) * row_bytes / (1 << 30), asked, rows)
                self.recurrent_rows = rows
            if self.snapshot_rows:
                # The prefix cache's snapshots: one a request where a quarter of the budget
                # holds them, else as many as it does (fewer than requests: the least
                # recently used goes first), so the cache never costs a running request.
                spare = budget * 3 // 4 - (self.recurrent_rows + 1) * row_bytes
                self.snapshot_rows = max(0, min(self.recurrent_rows, spare // row_bytes))
                if not self.snapshot_rows:
                    log.warning("no room for the prefix cache's snapshots of a hybrid's state in the KV cache's "
                                "budget (%s): prefix caching off (raise the budget for it)", asked)
            state_bytes = self._state_bytes()
            num_blocks = (budget - state_bytes) // bytes_per_block
            if num_blocks < 1:
                raise ValueError(f"the KV cache's budget ({asked}) is too small for one block"
                                 + (f" beside the recurrent state of {self.recurrent_rows} requests "
                                    f"({state_bytes / (1 << 30):.2f} GiB)" if state_bytes else ""))
        check_kv_cache_fits((num_blocks + 1) * bytes_per_block + state_bytes, self.device, asked)
        # More blocks than the longest request could use at max_num_seqs are wasted memory,
        # but we cannot know max_num_seqs here; the budget is the user's to set.
        return int(num_blocks)

    def _state_shapes(self, layer: int, rows: int | None = None) -> tuple:
        """A recurrent layer's state: its tensors' (shape, dtype), a row a request and a
        snapshot (`recurrent_rows` and `snapshot_rows` unless given) and the pad row."""
        rows = self.recurrent_rows + self.snapshot_rows if rows is None else rows
        return self.model.model.layers[layer].self_attn.state_shapes(rows + 1, self.dtype)

    def _state_bytes(self, rows: int | None = None) -> int:
        """The recurrent layers' state for `rows` rows (requests' and snapshots' unless given)."""
        return sum(math.prod(shape) * dtype.itemsize for i in self.model_config.recurrent_layers
                   for shape, dtype in self._state_shapes(i, rows))

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
        if scheduler_output.state_restores:  # a hybrid's prefix hits: their state, before the forward
            self._copy_states(scheduler_output.state_restores, to_snapshot=False)
        if not num_scheduled:
            return LaunchedStep.done(ModelRunnerOutput(step_id=scheduler_output.step_id, req_ids=[],
                                                       sampled_token_ids=[], request_errors=arrival_errors))
        if self._launched and not reads_device_tokens_only(self.requests, scheduler_output):
            self.finish_launched()
        # Speculation: drafts for the requests given slots; each computes its scheduled
        # tokens less the slots its drafts leave unused.
        drafts = self._propose(scheduler_output.num_draft_slots)
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

        t_forward = time.time_ns()
        graphs = self.decode_graphs
        on_graph = graphs is not None and not self.model.eager_only and graphs.takes(inputs)
        patch = (lambda ids: read_device_tokens(ids, from_device)) if len(from_device) else None
        if on_graph:
            hidden = graphs.run(inputs, patch)
        else:
            input_ids, positions, metadata = inputs.to_device(self.device)
            if patch is not None:
                patch(input_ids)
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        if scheduler_output.state_saves:  # the state at a block's end, for later prefix hits
            self._copy_states(scheduler_output.state_saves, to_snapshot=True)
        t_sample = time.time_ns()
        sampled: list[list[int]] = [[] for _ in order]
        logprobs: list[list] = [[] for _ in order]
        output = ModelRunnerOutput(
            step_id=scheduler_output.step_id, req_ids=order, sampled_token_ids=sampled, logprobs=logprobs,
            num_draft_tokens=[len(drafts.get(rid, ())) for rid in order] if drafts else [],
            request_errors=arrival_errors,
        )
        launched = LaunchedStep.done(output)
        mask_ns = 0  # the grammars' share of sampling (the step log reports it)
        # Most decode steps: every request samples the argmax, nothing else asked of it, so
        # none of the per-request passes below for grammars, prompt logprobs, embeddings,
        # the sampler's processing and logprobs has anything to find.
        argmax_only = not drafts and all(map(_ARGMAX_ONLY, states))
        constrained = [] if argmax_only else [i for i in sample_rows if states[i].matcher is not None]
        if any(isinstance(states[i].matcher, Future) for i in constrained):
            # A step of nothing but requests waiting for their grammars may wait for one a
            # little, rather than come straight back to compute the same token again.
            only_waiting = len(sample_rows) == len(states) and all(isinstance(s.matcher, Future) for s in states)
            wait_s = GRAMMAR_WAIT_S if only_waiting else 0.0
            if self.recurrent_rows:
                # A hybrid's recurrent layers have folded this step's tokens into their state
                # and cannot compute them again: it waits for its compiles instead.
                wait_s = None
            sample_rows, pending, failed = split_ready(states, sample_rows, wait_s)
            output.resample_req_ids = [order[i] for i in pending]
            output.request_errors.update({order[i]: why for i, why in failed.items()})
            self.drop_requests([order[i] for i in failed])
            constrained = [i for i in sample_rows if states[i].matcher is not None]
        if not argmax_only and any(s.prompt_logprobs is not None for s in states):  # (mostly none)
            sample_rows = self._add_prompt_logprobs(states, num_tokens, last_token, hidden, sample_rows, output)
            constrained = [i for i in sample_rows if states[i].matcher is not None]
        embeds = [] if argmax_only else [i for i in sample_rows if states[i].sampling_params.embed]  # (mostly none)
        if embeds:
            # Last-token pooling, as vLLM's for decoder models: the final norm's output at
            # the prompt's last position, L2-normalized (a sync, paid only by such steps).
            # Nothing samples for them (no logits: a model without an LM head embeds too);
            # the one token such a request ends with is a placeholder, never shown.
            rows = to_device(last_token[embeds], self.device)
            if self.model.score is not None:  # a classifier's: its score head's raw logits there
                vectors = self.model.score(hidden[rows]).float().tolist()
            else:
                vectors = F.normalize(hidden[rows].float(), dim=-1).tolist()
            output.pooled = {order[i]: vector for i, vector in zip(embeds, vectors)}
            for i in embeds:
                states[i].token_ids.append(EMBED_PLACEHOLDER)
                sampled[i] = [EMBED_PLACEHOLDER]
            sample_rows = [i for i in sample_rows if not states[i].sampling_params.embed]
            constrained = [i for i in sample_rows if states[i].matcher is not None]
        if sample_rows:
            # One logits row per sampled position: a request's last token, and before it
            # one per draft, each seen by the sampler with the drafts before it.
            if drafts:
                rows, row_states, first_row = [], [], []
                for i in sample_rows:
                    state, d = states[i], drafts.get(order[i], [])
                    first_row.append(len(rows))
                    rows.extend(range(int(last_token[i]) - len(d), int(last_token[i]) + 1))
                    row_states.extend([DraftPosition(state, d[:j]) for j in range(len(d) + 1)] if d else [state])
                rows = torch.tensor(rows)
            else:  # one row a request (every request, in a decode step: no index to apply)
                every = len(sample_rows) == len(states)
                rows = torch.from_numpy(last_token if every else last_token[sample_rows])
                row_states = states if every else [states[i] for i in sample_rows]
                first_row = range(len(sample_rows))
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
                plain = frozenset(r for r, st in enumerate(row_states) if plain_greedy(st))
                valid = dict(zip((job[0] for job in jobs), grammar.mask(logits, jobs, self.grammars.vocab_size, plain)))
                mask_ns = time.perf_counter_ns() - t_mask
            samples = self.sampler.argmax(logits) if argmax_only else self.sampler.sample(logits, row_states)
            if drafts or constrained or not self.overlap_steps:
                # Tokens land in order: those of steps launched before this one first.
                self.finish_launched()
                self._accept(samples, states, sample_rows, first_row, drafts, valid, order, sampled, logprobs,
                             bool(constrained))
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
            self._write_step_log(inputs, on_graph, len(sample_rows), mask_ns, drafts, sampled, order, behind)
        return launched

    def _accept(self, samples, states, sample_rows, first_row, drafts, valid, order, sampled, logprobs,
                constrained: bool) -> None:
        """On the host now: each request's accepted drafts and the token after them, its
        grammar advanced over them."""
        token_ids, token_logprobs = samples.to_host()
        if not (drafts or constrained):  # (valid is only filled for constrained rows)
            for i, first in zip(sample_rows, first_row):  # one token a request, nothing to check
                token_id = token_ids[first]
                states[i].token_ids.append(token_id)
                sampled[i] = [token_id]
                if token_logprobs[first] is not None:
                    logprobs[i] = [token_logprobs[first]]
            return
        for i, first in zip(sample_rows, first_row):
            state, d = states[i], drafts.get(order[i], [])
            accepted = num_accepted(d[:valid.get(first, len(d))], token_ids[first:first + len(d)])
            out = token_ids[first:first + accepted + 1]
            if state.matcher is not None:
                for token_id in out:
                    if state.matcher.is_terminated():
                        break
                    state.matcher.accept_token(token_id)
            state.token_ids.extend(out)
            state.num_computed_tokens -= len(d) - accepted  # rejected drafts' K/V is stale
            sampled[i] = out
            logprobs[i] = [lp for lp in token_logprobs[first:first + accepted + 1] if lp is not None]

    def _add_prompt_logprobs(self, states, num_tokens, last_token, hidden, sample_rows, output) -> list[int]:
        """This step's prompt positions' logprobs into their requests' states; a request
        that samples now (its prompt is done) sends them (prompt_logprobs.py). Returns the
        sampling rows less any request that failed here."""
        failed = set()
        for i, state in enumerate(states):
            if state.prompt_logprobs is None:
                continue
            n = num_tokens[state.req_id]
            try:
                add_chunk(self.model, hidden, int(last_token[i]) - n + 1, state.num_computed_tokens, n, state)
            except ValueError as exc:  # positions it never computed here: fail it alone
                output.request_errors[state.req_id] = f"prompt logprobs: {exc}"
                failed.add(i)
        if failed:
            self.drop_requests([states[i].req_id for i in failed])
            sample_rows = [i for i in sample_rows if i not in failed]
        for i in sample_rows:
            state = states[i]
            if state.prompt_logprobs is not None:
                output.prompt_logprobs[state.req_id], state.prompt_logprobs = state.prompt_logprobs, None
        return sample_rows

    def _recurrent_refusal(self, new, snapshot: int | None) -> str | None:
        """Why a hybrid model cannot take this request now (None: it can): its recurrent
        layers' state starts from a request's first token or from a `snapshot` of the state
        at a cached block's end, in one of `recurrent_rows` rows. The scheduler keeps within
        both (Scheduler's recurrent_rows); this says so should anything else reach here."""
        if new.num_computed_tokens and (snapshot is None or not 0 <= snapshot < self.snapshot_rows):
            return (f"a {self.model_config.architecture} request cannot start at token {new.num_computed_tokens}: "
                    "its recurrent layers' state is computed from the first token or a snapshot")
        if self.block_table.num_rows_in_use >= self.recurrent_rows:
            return (f"this worker holds {self.recurrent_rows} requests at most (--max-num-seqs): its "
                    "recurrent state has no row left")
        return None

    def _copy_states(self, slots: dict[str, int], to_snapshot: bool) -> None:
        """Copy the recurrent state of each request (its row) to its snapshot slot, or
        back: every recurrent layer's tensors, in the step's stream order (a restore lands
        before the forward reads the row, a save after the forward wrote it). Snapshots
        lie past the pad row. A request the worker dropped (it failed as it arrived) is
        skipped: the scheduler hears of its error and never finds that save."""
        pairs = [(self.requests[rid].block_row, self.recurrent_rows + 1 + slot)
                 for rid, slot in slots.items() if rid in self.requests]
        if not pairs:
            return
        rows, snapshots = (to_device(side, self.device, torch.int64) for side in zip(*pairs))
        src, dst = (rows, snapshots) if to_snapshot else (snapshots, rows)
        for layer in self.model_config.recurrent_layers:
            for tensor in self.kv_caches[layer]:
                tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def _propose(self, num_draft_slots: dict[str, int]) -> dict[str, list[int]]:
        if self.proposer is None or not num_draft_slots:
            return {}
        drafts = {}
        for rid, slots in num_draft_slots.items():
            state = self.requests.get(rid)
            if state is not None and not isinstance(state.matcher, Future):  # a grammar still compiling: none
                threshold = self.model_config.long_rope_threshold
                if threshold is not None and not state.long_rope and len(state.token_ids) + slots > threshold:
                    continue  # drafts would cross the longrope threshold, where the request restarts
                proposed = self.proposer.propose(state.token_ids, slots)
                if proposed:
                    drafts[rid] = proposed
        return drafts

    def _prepare_lora(self, lora) -> LoRAAdapter | str:
        """The adapter, read, or why it cannot be."""
        if self.loras is None:
            return lora.not_served()  # (the scheduler refuses it first; a twin for a stray placement)
        try:
            return self.loras.prepare(lora)
        except (ValueError, OSError) as exc:
            return str(exc)

    def _write_step_log(self, inputs: StepInputs, on_graph: bool, num_sampled: int, mask_ns: int,
                        drafts: dict[str, list[int]], sampled: list[list[int]], order: list[str],
                        launched_behind: int) -> None:
        start, forward, sample, end = self.last_step_ns
        num_drafts = sum(len(d) for d in drafts.values())
        accepted = sum(len(out) - 1 for rid, out in zip(order, sampled) if rid in drafts and out)
        self._step_log.write(json.dumps({
            "pid": os.getpid(), "start_ns": start, "prepare_ms": (forward - start) / 1e6,
            "forward_ms": (sample - forward) / 1e6, "sample_ms": (end - sample) / 1e6, "mask_ms": mask_ns / 1e6,
            "tokens": inputs.num_tokens, "reqs": inputs.num_rows,
            "decodes": inputs.num_decodes, "sampled": num_sampled,
            "context": int(inputs.seq_lens.sum()), "graph": on_graph,
            "draft_tokens": num_drafts, "accepted_tokens": accepted, "launched_behind": launched_behind,
        }) + "\n")

    def _update_states(self, so: SchedulerOutput) -> None:
        if so.reset:
            self.drop_requests(list(self.requests))
        self.drop_requests(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            spec = new.sampling_params.structured_outputs
            self.drop_requests([new.req_id])  # (sent again whole: resumed or preempted)
            refusal = self._recurrent_refusal(new, so.state_restores.get(new.req_id)) if self.recurrent_rows else None
            adapter = refusal or (self._prepare_lora(new.lora_request) if new.lora_request is not None else None)
            if isinstance(adapter, str):  # it fails alone; the step goes on without it
                self._arrival_errors[new.req_id] = adapter
                so.num_scheduled_tokens.pop(new.req_id, None)
                so.num_draft_slots.pop(new.req_id, None)
                continue
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                eos_token_id=new.eos_token_id,
                block_row=self.block_table.add(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                # New to this worker (first step, resumed, preempted, migrated): a fresh
                # matcher, with the tokens already generated replayed into it.
                matcher=self.grammars.start_matcher(spec, new.output_token_ids) if spec is not None else None,
                long_rope=(self.model_config.long_rope_threshold is not None
                           and len(new.prompt_token_ids) + len(new.output_token_ids) > self.model_config.long_rope_threshold),
                # (one with output already sent them with its first token)
                prompt_logprobs=[] if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids
                else None,
                lora=adapter,
            )
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
