"""Steps launched before the one before them has finished (services/worker/launched_step.py):
offline, the engine core hands the runner step N+1 before it takes step N's tokens to the
host, and N+1 reads N's tokens where they were sampled, on the device. Outputs must be
those of finishing every step at once (`overlap_steps` off) and transformers' — greedy,
seeded with logprobs, beside requests whose penalties or grammar need the tokens on the
host (the runner finishes the launched steps first for those), on the eager path and
from the decode graphs' buffers, chunked and preempted — and the overlap must in fact
have happened. A GPU runner overlaps by default; here each test turns it on."""

import pytest
import torch

from llmbus import LLM, SamplingParams
from services.worker import model_runner
from services.worker.model_runner import ModelRunner
from shared.sampling_params import StructuredOutputsParams
from tiny_models import hf_greedy, random_prompts

PROMPTS = random_prompts([1, 5, 16, 17, 33, 64])
MAX_NEW = 20


@pytest.fixture
def overlaps(monkeypatch):
    """How many steps were launched while another's tokens were still on the device, how
    many input ids were read from the device, and in how many steps all of them were
    the last step's ids as they lay (LaunchedStep.fed_back: one copy, no gather)."""
    seen = {"launched_behind": 0, "device_reads": 0, "fed_back": 0}
    launch, read = ModelRunner.launch, model_runner.read_device_tokens

    def counting_launch(self, so):
        seen["launched_behind"] += bool(self._launched)
        return launch(self, so)

    def counting_read(input_ids, from_device):
        seen["device_reads"] += len(from_device)
        seen["fed_back"] += isinstance(from_device, torch.Tensor)
        return read(input_ids, from_device)

    monkeypatch.setattr(ModelRunner, "launch", counting_launch)
    monkeypatch.setattr(model_runner, "read_device_tokens", counting_read)
    return seen


def outputs(llm: LLM, params) -> list:
    return [(o.outputs[0].token_ids, [[lp.logprob for lp in position.values()] for position in o.outputs[0].logprobs or []])
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def flat(outs) -> list[float]:
    """Every logprob of every request, in order (pytest.approx takes flat sequences)."""
    return [value for _, lps in outs for position in lps for value in position]


def overlapping(folder, **kwargs) -> LLM:
    """An LLM whose runner overlaps steps (the default on CUDA only)."""
    llm = LLM(str(folder), **kwargs)
    llm.runner.overlap_steps = True
    return llm


@pytest.mark.parametrize("graphs, options", [
    (None, {}),
    ("replay", {}),
    (None, {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8}),  # chunked prefill
    (None, {"num_kv_blocks": 12, "block_size": 16, "enable_prefix_caching": False}),  # preemption
], ids=["eager", "graphs_replay", "chunked", "preempted"])
def test_greedy_from_tokens_on_the_device_equals_transformers(tiny_llama, overlaps, graphs, options):
    llm = overlapping(tiny_llama, **options)
    if graphs:
        llm.runner.set_decode_graphs(graphs)
    got = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)]
    assert got == hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
    assert overlaps["launched_behind"] >= MAX_NEW - 2 and overlaps["device_reads"] >= len(PROMPTS) * (MAX_NEW - 2)
    if not options:  # every request decodes in lockstep once prefilled: the same batch, the same order
        assert overlaps["fed_back"] >= MAX_NEW - 3
    assert not llm.runner._launched and all(s.num_pending == 0 for s in llm.runner.requests.values())


def test_penalized_requests_overlap_counting_their_latest_token_on_the_device(tiny_llama, overlaps):
    """Penalties count a request's tokens on the device (penalties.py), the latest one
    where it was sampled: penalized requests overlap steps too, and greedy with a
    repetition penalty still equals transformers'."""
    llm = overlapping(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.8)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == hf_greedy(tiny_llama, PROMPTS, MAX_NEW, repetition_penalty=1.8)
    assert got != hf_greedy(tiny_llama, PROMPTS, MAX_NEW)  # the penalty changed something
    assert overlaps["launched_behind"] >= MAX_NEW - 2 and overlaps["device_reads"] >= len(PROMPTS) * (MAX_NEW - 2)


def test_every_kind_of_request_as_when_each_step_finishes_at_once(tiny_llama, overlaps):
    """Seeded sampling with logprobs and min_tokens counts the tokens still on the device
    (its draw positions, its bans); beside a request with penalties and a constrained one,
    which need the tokens on the host, the runner lands the launched steps first."""
    n = len(PROMPTS)
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2, min_tokens=3)
              for i in range(n)]
    mixed = seeded[: n - 2] + [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, structured_outputs=StructuredOutputsParams(
            regex="[0-9]{3}-[a-z]{2}"))]
    llm = overlapping(tiny_llama, enable_prefix_caching=False)  # a prefix hit moves logprobs by an ulp
    results = {}
    for overlap in (True, False):
        llm.runner.overlap_steps = overlap
        before = overlaps["device_reads"]
        results[overlap] = outputs(llm, seeded), outputs(llm, mixed)
        assert (overlaps["device_reads"] > before) == overlap
    # Tokens exactly; logprobs to a few ulps: the constrained request's matcher compiles on
    # a thread of its own, and when it is late the request is computed a step later - a
    # batch of another size, whose CPU matmuls round the other rows' last bits otherwise.
    # A draw at a wrong position or a ban left on would move them by far more.
    for with_overlap, finished_at_once in zip(results[True], results[False]):
        assert [tokens for tokens, _ in with_overlap] == [tokens for tokens, _ in finished_at_once]
        assert flat(with_overlap) == pytest.approx(flat(finished_at_once), rel=1e-5, abs=1e-6)
    for prompt, param, expected in zip(PROMPTS, mixed, results[True][1]):  # alone, the tokens it had in the crowd
        [out] = llm.generate([prompt], param, use_tqdm=False)
        assert out.outputs[0].token_ids == expected[0]


def test_finishing_a_step_lands_the_steps_launched_before_it_first(tiny_llama):
    """Tokens reach a request's state in the order they were sampled, whichever launched
    step is finished first."""
    llm = overlapping(tiny_llama)
    llm.add_requests([PROMPTS[2]], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    scheduler, runner = llm.scheduler, llm.runner

    def launch_three():
        launched = [runner.launch(scheduler.schedule()) for _ in range(3)]  # prefill, then two decodes
        [state] = runner.requests.values()
        assert state.num_pending == 3 and len(state.token_ids) == len(PROMPTS[2])
        last = launched[-1].finish()
        assert all(step.finished for step in launched) and not runner._launched and state.num_pending == 0
        firsts = [step.output.sampled_token_ids[0][0] for step in launched[:2]]
        return state.token_ids[len(PROMPTS[2]):], firsts + last.sampled_token_ids[0]

    landed, sampled = llm.executor.call(launch_three)
    assert landed == sampled == hf_greedy(tiny_llama, [PROMPTS[2]], 3)[0]


def test_the_step_path_copies_host_values_to_the_device_without_waiting_for_it():
    """`torch.tensor(..., device=...)` and a plain `.to(device)` synchronize the stream on
    CUDA: in a step launched beside the one before, the host would wait for it (no overlap);
    so does assigning a Python scalar at device index tensors, and CUDA may wait so for a
    non-blocking copy out of pageable memory (`.to(device, non_blocking=True)`).
    The step path copies through services/worker/host_values.py instead, which pins what it
    copies. (On a GPU, scripts/gpu_check.py's host_syncs and host_waits cases check the
    calls themselves and that a step launches while the device is busy.)"""
    import re
    from pathlib import Path

    worker = Path(__file__).resolve().parents[1] / "services" / "worker"
    step_path = ["model_runner.py", "sample/sampler.py", "launched_step.py", "step_inputs.py", "sample/grammar.py",
                 "sample/acceptance.py", "pooling.py", "recurrent_state.py", "device_tokens.py",
                 "sample/spec_decode.py", "sample/random_draws.py", "sample/penalties.py", "sample/bad_words.py",
                 "layers/lora.py"]
    # (and `t[device_indices] = scalar`, which copies the scalar over synchronously: put_scalar)
    waiting = re.compile(r"torch\.tensor\([^)]*device=|\.to\((self\.)?device\)|\.to\([^)]*non_blocking|\[[^\]]*to_device\(.*\]\s*=\s*(_MASK|True|False|[-\d.]+)\s*$")
    found = [f"{name}:{n}: {line.strip()}" for name in step_path
             for n, line in enumerate((worker / name).read_text().splitlines(), 1) if waiting.search(line)]
    assert found == []


@pytest.mark.timeout(300)
def test_llmbus_serve_launches_each_step_before_answering_the_one_before(tiny_llama, tmp_path):
    """Served (services/worker/shell/served_steps.py): the scheduler keeps two steps in flight, so
    the worker launches the next one before it answers the one before, which reads the
    tokens on the device. Greedy through `llmbus serve` and the openai client equals
    transformers, and the worker's step log shows steps launched behind unanswered ones."""
    import asyncio
    import json

    import openai

    from deployment import llmbus_serve

    step_log = tmp_path / "steps.jsonl"
    proc, url = llmbus_serve(["--model", str(tiny_llama), "--served-model-name", "tiny"], tmp_path / "stderr.log",
                             env={"LLMBUS_OVERLAP_STEPS": "1", "LLMBUS_STEP_LOG": str(step_log)})
    try:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def complete(prompt):
            out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                                  logprobs=0, extra_body={"ignore_eos": True,
                                                                          "return_tokens_as_token_ids": True})
            return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

        async def complete_all():
            return await asyncio.gather(*map(complete, PROMPTS))

        got = asyncio.run(complete_all())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert got == hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    behind = sum(s["launched_behind"] > 0 for s in steps)
    # (About half of them on this CPU, where every step is ready as soon as it is launched;
    # finished one at a time, none.)
    assert behind >= 3, f"{behind} of {len(steps)} steps launched behind an unanswered one"


@pytest.mark.parametrize("values", [[1, 2, -3], [0.5, 1e-3, 2.0], [True, False], [], [[1, 2], [3, 4]], [2**40, 1]])
@pytest.mark.parametrize("dtype", [None, "float32", "float64", "int64", "int32", "bool", "bfloat16"])
def test_host_lists_become_the_tensors_torch_tensor_makes(values, dtype):
    """host_values.from_list (numpy, faster) gives torch.tensor's dtype and values."""
    import torch

    from services.worker.host_values import from_list

    dtype = getattr(torch, dtype) if dtype else None
    if dtype == torch.int32 and values == [2**40, 1]:  # out of int32's range: refused either way
        with pytest.raises((RuntimeError, OverflowError)):
            torch.tensor(values, dtype=dtype)
        with pytest.raises((RuntimeError, OverflowError)):
            from_list(values, dtype)
        return
    expected = torch.tensor(values, dtype=dtype)
    got = from_list(values, dtype)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)


def test_device_tokens_are_gathered_from_each_step_that_sampled_them():
    """One index for all when one step sampled every token (the usual case); one per step
    otherwise (a request that sat out the newest step waits on an older one's ids)."""
    import torch

    from services.worker.device_tokens import gather_device_tokens, read_device_tokens

    older, newer = torch.tensor([10, 11, 12]), torch.tensor([20, 21, 22, 23])
    one_step = gather_device_tokens([(5, (newer, 3)), (0, (newer, 0)), (2, (newer, 2))])
    assert [(keys, tokens.tolist()) for keys, tokens in one_step] == [([5, 0, 2], [23, 20, 22])]
    two_steps = gather_device_tokens([(0, (newer, 1)), (1, (older, 2)), (2, (newer, 3)), (3, (older, 0))])
    assert sorted((keys, tokens.tolist()) for keys, tokens in two_steps) == [([0, 2], [21, 23]), ([1, 3], [12, 10])]
    assert gather_device_tokens([]) == []
    input_ids = torch.zeros(6, dtype=torch.int64)
    read_device_tokens(input_ids, [(4, (older, 1)), (1, (newer, 2))])
    assert input_ids.tolist() == [0, 22, 0, 0, 11, 0]
