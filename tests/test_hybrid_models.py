"""Hybrid models (Qwen3.5: Gated DeltaNet layers beside full attention; LFM2: short
convolutions beside it; Granite 4.0-H: Mamba2) keep a recurrent state a request in place
of KV blocks (layers/gated_delta_net.py, short_conv.py, mamba2.py), a row of it for each
request the worker may hold. Beyond test_model_families.py's cases (every scheduling mode,
the Triton kernels, the graph buffers, logprobs): a row another request left starts from
zeros, the scheduler keeps within the rows, a cached prefix starts from a snapshot of the
state at its end (offline and through `llmbus serve`), the state is paid out of the KV budget, what such a model cannot do is
refused by name, the multimodal checkpoints serve their language model, and bfloat16
stays as close to float32 as transformers' own."""

import concurrent.futures
import math

import openai
import pytest

from deployment import llmbus_serve
from llmbus import LLM, SamplingParams
from services.scheduler.core.scheduler import Scheduler
from services.worker.model_runner import ModelRunner
from shared.config import SchedulerConfig
from shared.messages import CachedRequestData, NewRequestData, SchedulerOutput
from tiny_models import build_tiny_model, hf_greedy, random_prompts

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", seed=2)


def generate_ids(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2", "granite_hybrid"])
def test_a_row_another_request_left_starts_from_zeros(tmp_path, arch):
    """Two rows for seven requests: each row serves several in turn, and a one-token prompt
    (computed as a decode) lands on a row a finished request left its state in (the
    DeltaNet's and the convolutions' state: Qwen3.5's; the convolutions' alone: LFM2's;
    Mamba2's scan and convolutions: Granite 4.0-H's)."""
    folder = build_tiny_model(tmp_path / arch, arch, seed=2)
    prompts = random_prompts([1, 12, 1, 30, 1, 5, 1], seed=3)
    llm = LLM(str(folder), max_num_seqs=2)
    assert llm.runner.recurrent_rows == 2
    assert generate_ids(llm, prompts) == hf_greedy(folder, prompts, MAX_NEW)


def test_the_scheduler_keeps_within_the_rows_and_caches_prefixes_only_with_snapshots(hybrid):
    llm = LLM(str(hybrid), max_num_seqs=3, enable_prefix_caching=True)
    assert (llm.scheduler.config.max_num_seqs, llm.scheduler.config.enable_prefix_caching) == (3, True)
    assert (llm.runner.recurrent_rows, llm.runner.snapshot_rows, llm.scheduler.snapshots.num_slots) == (3, 3, 3)
    off = LLM(str(hybrid), max_num_seqs=3, enable_prefix_caching=False)
    assert (off.runner.snapshot_rows, off.scheduler.config.enable_prefix_caching, off.scheduler.snapshots) == (0, False, None)
    # Served, the worker's announcement says how many rows it has (WorkerInfo.recurrent_rows)
    # and how many snapshots (recurrent_snapshot_rows): none, no prefix cache
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8), 64, 16, 384, recurrent_rows=4)
    assert (scheduler.config.max_num_seqs, scheduler.config.enable_prefix_caching) == (4, False)
    snapshots = Scheduler(SchedulerConfig(max_num_seqs=8), 64, 16, 384, recurrent_rows=4, recurrent_snapshot_rows=4)
    assert (snapshots.config.max_num_seqs, snapshots.config.enable_prefix_caching) == (4, True)
    plain = Scheduler(SchedulerConfig(max_num_seqs=8), 64, 16, 384)
    assert (plain.config.max_num_seqs, plain.config.enable_prefix_caching) == (8, True)


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2", "granite_hybrid"])
def test_a_cached_prefix_starts_from_the_state_saved_at_its_end(tmp_path, arch):
    """A hybrid's prefill stops at its last block boundary, where the worker saves its
    recurrent state (services/scheduler/core/state_snapshots.py); the same prompt again, another
    sharing its first blocks, and a conversation's next turn start there from that state:
    each equal to transformers computing it whole (the DeltaNet's and the convolutions'
    state: Qwen3.5's; the convolutions' alone: LFM2's; Mamba2's scan and convolutions:
    Granite 4.0-H's). Then with a cache so small that requests are preempted and come back
    to their own snapshots."""
    folder = build_tiny_model(tmp_path / arch, arch, seed=2)
    prefix = random_prompts([40], seed=7)[0]
    first = prefix + random_prompts([3], seed=8)[0]  # 43 tokens: its state saved after 32
    llm = LLM(str(folder), max_num_seqs=4)
    answer = llm.generate([first], GREEDY, use_tqdm=False)[0]
    assert answer.num_cached_tokens == 0
    again = [first, prefix + random_prompts([9], seed=9)[0], first + list(answer.outputs[0].token_ids) + [5, 6, 7]]
    outputs = llm.generate(again, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [32, 32, 32]
    assert [answer.outputs[0].token_ids] + [o.outputs[0].token_ids for o in outputs] \
        == hf_greedy(folder, [first] + again, MAX_NEW)

    prompts = random_prompts([50, 37, 66, 20], seed=11)
    tight = LLM(str(folder), max_num_seqs=4, num_kv_blocks=9, max_num_batched_tokens=32)
    assert generate_ids(tight, prompts) == hf_greedy(folder, prompts, MAX_NEW)
    assert tight.stats().num_preemptions > 0


def test_the_state_is_paid_out_of_the_kv_budget(hybrid):
    budget = 1 << 23
    runners = {rows: LLM(str(hybrid), max_num_seqs=rows, kv_cache_memory_bytes=budget).runner for rows in (1, 64)}
    runner = runners[1]
    cfg = runner.model_config
    # a block: K and V of the one attention layer; a row: each linear layer's two states
    block_bytes = 2 * len(cfg.attention_layers) * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    conv = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    row_bytes = len(cfg.recurrent_layers) * 4 * (conv * (cfg.linear_conv_kernel_dim - 1) + cfg.linear_num_value_heads
                                             * cfg.linear_key_head_dim * cfg.linear_value_head_dim)
    for rows, r in runners.items():  # (a row a request, a snapshot a request, and the pad row, where a
        # graph's padded rows write)
        assert r.num_blocks == (budget - (2 * rows + 1) * row_bytes) // block_bytes
        states = [cache for cache in r.kv_caches if isinstance(cache, tuple)]
        assert len(states) == 3 and sum(math.prod(t.shape) * t.element_size() for s in states for t in s) \
            == (2 * rows + 1) * row_bytes
    # A budget whose half cannot hold --max-num-seqs rows (the default 1 GiB cannot hold
    # Qwen3.5-0.8B's 128): as many run at once as half of it holds, the scheduler told so,
    # the prefix cache or not; its snapshots then as many as a quarter holds.
    small = 1 << 20
    rows = small // 2 // row_bytes - 1
    snapshots = (small * 3 // 4 - (rows + 1) * row_bytes) // row_bytes
    assert 0 < snapshots < rows < 64
    for caching in (True, False):
        llm = LLM(str(hybrid), max_num_seqs=64, kv_cache_memory_bytes=small, enable_prefix_caching=caching)
        assert (llm.runner.recurrent_rows, llm.scheduler.config.max_num_seqs) == (rows, rows)
        assert (llm.runner.snapshot_rows, llm.scheduler.config.enable_prefix_caching) == \
            ((snapshots, True) if caching else (0, False))
        assert llm.runner.num_blocks == (small - (rows + 1 + llm.runner.snapshot_rows) * row_bytes) // block_bytes
    prompts = random_prompts([3, 20], seed=4)
    assert generate_ids(llm, prompts) == hf_greedy(hybrid, prompts, MAX_NEW)


def test_what_a_hybrid_cannot_do_is_refused_by_name(hybrid):
    with pytest.raises(ValueError, match="speculative decoding is not supported for Qwen3_5ForCausalLM"):
        LLM(str(hybrid), speculative_config={"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="--enable-lora is not supported for Qwen3_5ForCausalLM"):
        LLM(str(hybrid), enable_lora=True)


def test_the_worker_refuses_a_request_it_has_no_state_for(hybrid):
    """The scheduler never sends one, but a worker that got one past its first token (a
    cached prefix), or more than its rows, fails that request alone, with the reason."""
    runner = ModelRunner(hybrid, max_num_seqs=1)

    def new(req_id: str, computed: int, blocks: list[int]) -> NewRequestData:
        return NewRequestData(req_id, list(range(3, 23)), [], GREEDY, None, blocks, computed)

    out = runner.execute_model(SchedulerOutput(
        0, [new("past", 16, [0, 1]), new("first", 0, [2, 3]), new("extra", 0, [4, 5])], CachedRequestData(),
        {"past": 4, "first": 20, "extra": 20}, 44))
    assert "cannot start at token 16" in out.request_errors["past"]
    assert "holds 1 requests at most" in out.request_errors["extra"]
    assert out.req_ids == ["first"] and len(out.sampled_token_ids[0]) == 1


def test_served_by_llmbus_serve_as_transformers_computes_it(hybrid, tmp_path):
    """`llmbus serve` with its defaults (the prefix cache on) and two requests a row: the
    worker tells the scheduler its rows and its snapshots, so prompts sharing a prefix start
    from the first one's state at its last block boundary, and a burst waits its turn for a
    row."""
    proc, url = llmbus_serve([str(hybrid), "--served-model-name", "tiny", "--max-num-seqs", "2"],
                             tmp_path / "stderr.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        prefix = random_prompts([40], seed=7)[0]
        prompts = [prefix + tail for tail in random_prompts([3, 9, 1], seed=8)] + random_prompts([1, 20, 7], seed=9)

        cached = []

        def token_ids(prompt: list[int]) -> list[int]:
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                               logprobs=0, extra_body={"ignore_eos": True,
                                                                       "return_tokens_as_token_ids": True})
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
            return [int(token.removeprefix("token_id:")) for token in answer.choices[0].logprobs.tokens]

        # one after another: the second and third hit the first's first two blocks and its
        # state after them (it is 43 tokens: saved after 32)
        got = [token_ids(prompt) for prompt in prompts[:3]]
        assert cached == [0, 32, 32]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # three at once for two rows
            got += list(pool.map(token_ids, prompts[3:]))
        assert got == hf_greedy(hybrid, prompts, MAX_NEW)
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("arch, text_model", [("qwen3_5_vl", "Qwen3_5ForCausalLM"),
                                              ("qwen3_5_moe_vl", "Qwen3_5MoeForCausalLM")])
def test_qwen3_5_checkpoint_serves_its_language_model(tmp_path, arch, text_model):
    """Qwen3.5 ships every size as Qwen3_5ForConditionalGeneration (the MoE ones as
    Qwen3_5MoeForConditionalGeneration): its language model
    serves text, equal to transformers' multimodal model on text (interleaved MRoPE is the
    ordinary rotary there); the vision tower and the multi-token-prediction module (`mtp.*`,
    added here as the Hub's checkpoints hold one) are left unread."""
    import transformers
    from safetensors.torch import load_file, save_file

    folder = build_tiny_model(tmp_path / "mm", arch, seed=2)
    prompts = random_prompts([1, 5, 17, 40, 70])
    model_class = getattr(transformers, text_model.replace("ForCausalLM", "ForConditionalGeneration"))
    want = hf_greedy(folder, prompts, MAX_NEW, model_class=model_class)
    weights = load_file(folder / "model.safetensors")
    assert any(name.startswith("model.visual.") for name in weights)
    weights["mtp.fc.weight"] = weights["model.language_model.embed_tokens.weight"][:, :8].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(folder))
    assert (llm.runner.model_config.architecture, llm.runner.model_config.recurrent_layers) == (text_model, (0, 1, 2))
    assert generate_ids(llm, prompts) == want


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "granite_hybrid",
                                  "granite_hybrid_dense", "bamba", "nemotron_h"])
def test_bfloat16_and_int8_stay_as_close_to_float32_as_transformers_bfloat16(tmp_path, arch):
    """A hybrid's bfloat16 parts from float32's greedy output sooner than a Llama's, in
    transformers too (on these models its own bfloat16 keeps 3 to 12 of 24 tokens), so
    greedy agreement cannot say whether a path lost something. The prompts' logprobs can:
    their error against transformers' float32 must stay within twice transformers' own
    bfloat16 error (measured 1.0-1.5x), and int8's within three times; a dropped norm or
    gate, or a state kept in bfloat16, moves them by far more."""
    import torch

    from tiny_models import causal_lm_class

    folder = build_tiny_model(tmp_path / arch, arch, seed=2)
    prompts = random_prompts([40, 66, 30])
    targets = [torch.tensor(p[1:]) for p in prompts]

    def transformers_logprobs(dtype):
        model = causal_lm_class(folder).from_pretrained(folder, dtype=dtype).eval()
        with torch.no_grad():
            return [model(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1)[torch.arange(len(t)), t]
                    for p, t in zip(prompts, targets)]

    def error(got) -> float:
        return float(torch.cat([(g - w).abs() for g, w in zip(got, want)]).mean())

    want, theirs = transformers_logprobs(torch.float32), transformers_logprobs(torch.bfloat16)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    ours = {}
    for quantization in (None, "int8"):
        outputs = LLM(str(folder), dtype="bfloat16", quantization=quantization).generate(prompts, params,
                                                                                          use_tqdm=False)
        ours[quantization] = error([torch.tensor([entry[token].logprob for token, entry in
                                                  zip(p[1:], o.prompt_logprobs[1:])]) for p, o in zip(prompts, outputs)])
    assert ours[None] <= 2 * error(theirs) and ours["int8"] <= 3 * error(theirs), (ours, error(theirs))


def test_a_grammar_still_compiling_is_waited_for_not_computed_twice(hybrid, monkeypatch):
    """Elsewhere a request whose grammar is still compiling when it first samples computes
    its last token again at the next step (the scheduler's resample); a hybrid's state
    cannot take a token twice, so its worker waits for the compile. Compiles slowed here,
    so every first sample finds its grammar compiling: the output is still transformers'
    with xgrammar's mask."""
    import time

    from shared.structured_output import GrammarBackend
    from test_structured_outputs import MAX_TOKENS, SPECS, hf_constrained

    compile_matcher = GrammarBackend.matcher

    def slow_matcher(self, spec, output_token_ids):
        time.sleep(0.3)
        return compile_matcher(self, spec, output_token_ids)

    monkeypatch.setattr(GrammarBackend, "matcher", slow_matcher)
    llm = LLM(str(hybrid))
    prompts = random_prompts([6, 25], seed=5)
    spec = SPECS["regex"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec),
                        use_tqdm=False)
    assert [[t for t in o.outputs[0].token_ids if t != llm.eos_token_id] for o in outs] == \
        hf_constrained(hybrid, spec, prompts)


@pytest.mark.parametrize("delta_rule", [False, True])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
def test_the_chunked_and_the_stepped_recurrence_equal_it_token_by_token(length, delta_rule):
    """layers/linear_recurrence.py against its definition, a token at a time from a given
    state: the chunked form (across chunk boundaries) and the vectorized step."""
    import torch

    from services.worker.layers.linear_recurrence import chunked_recurrence, recurrent_step

    g = torch.Generator().manual_seed(length)
    heads, k_dim, v_dim = 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(length, heads, k_dim, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(length, heads, v_dim, generator=g)
    decay = -torch.rand(length, heads, generator=g) * 0.3
    beta = torch.rand(length, heads, generator=g) if delta_rule else None
    start = torch.randn(heads, k_dim, v_dim, generator=g)
    state, want = start.clone(), []
    for t in range(length):
        state = state * decay[t].exp()[:, None, None]
        delta = v[t] if beta is None else beta[t][:, None] * (v[t] - (state * k[t][..., None]).sum(-2))
        state = state + k[t][..., None] * delta[:, None, :]
        want.append((state * q[t][..., None]).sum(-2))
    out, final = chunked_recurrence(q, k, v, decay, start.clone(), beta)
    torch.testing.assert_close(out, torch.stack(want), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, state, rtol=1e-4, atol=1e-4)
    # The last token as a step of two requests (rows 2 and 0 of three): one carrying its
    # state from the tokens before, the other a first token, from zeros whatever its row holds
    if length > 1:
        states = torch.randn(3, heads, k_dim, v_dim, generator=g)
        states[2] = chunked_recurrence(q[:-1], k[:-1], v[:-1], decay[:-1], start.clone(),
                                       None if beta is None else beta[:-1])[1]
        two = lambda x: None if x is None else torch.stack((x[-1], x[-1]))  # noqa: E731
        stepped = recurrent_step(*(two(x) for x in (q, k, v, decay)), states, torch.tensor([2, 0]),
                                 torch.tensor([True, False]), two(beta))
        torch.testing.assert_close(stepped[0], want[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states[2], state, rtol=1e-4, atol=1e-4)
        delta = v[-1] if beta is None else beta[-1][:, None] * v[-1]
        torch.testing.assert_close(stepped[1], (k[-1][..., None] * delta[:, None, :] * q[-1][..., None]).sum(-2),
                                   rtol=1e-4, atol=1e-4)


def test_nemotron_3_mixture_of_experts_blocks_are_refused_by_name(tmp_path):
    import json

    from transformers import NemotronHConfig

    from services.worker.models.decoder_config import ModelConfig

    config = NemotronHConfig(hybrid_override_pattern="ME*E", hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["NemotronHForCausalLM"]},
                                                     default=str))
    with pytest.raises(ValueError, match="unsupported Nemotron-H mixture-of-experts blocks"):
        ModelConfig.from_folder(tmp_path)
