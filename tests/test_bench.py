"""The benchmark commands run end to end on a tiny model (their figures are for the real
one, by hand; here only that they measure what they say and keep working)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from services.worker.layers.quantized_linear import Int8Linear

from llmbus.bench.agreement import compare
from llmbus.bench.roofline import matmul_flops, model_weights
from llmbus.cli.main import main
from services.worker.model_runner import ModelRunner
from services.worker.loader import iter_weights
from tiny_models import build_lora_adapter, build_tiny_model


def last_json(out: str):
    return json.loads(out.strip().splitlines()[-1])


def test_agreement_counts_identical_outputs_and_the_prefix_before_the_first_difference():
    agreement, prefixes = compare([[1, 2, 3, 4], [5, 6], [7, 8, 9]], [[1, 2, 3, 4], [5, 0], [0, 8, 9]])
    assert prefixes == [4, 1, 0]
    assert (agreement.identical, agreement.prompts) == (1, 3)
    assert (agreement.matching_prefix_tokens, agreement.tokens) == (5, 9)


@pytest.mark.parametrize("tied", [True, False])
def test_decode_weight_bytes_count_the_lm_head_once_and_skip_an_untied_input_embedding(tmp_path, tied):
    folder = build_tiny_model(tmp_path, "llama", tie_word_embeddings=tied)
    runner = ModelRunner(folder, dtype="bfloat16")  # its Linear weights are packed buffers
    params, weight_bytes = model_weights(runner.model, tied)
    cfg = runner.model_config
    embedding = cfg.vocab_size * cfg.hidden_size
    checkpoint = dict(iter_weights(folder))  # tied: no LM head of its own
    assert params == sum(t.numel() for t in checkpoint.values())
    # bf16: 2 bytes a weight; untied, the input embedding is one row per token, not read whole.
    assert weight_bytes == 2 * (params if tied else params - embedding)


@pytest.mark.parametrize("tied", [True, False])
def test_int8_weight_bytes_are_one_per_weight_plus_scales(tmp_path, tied):
    folder = build_tiny_model(tmp_path, "llama", tie_word_embeddings=tied)
    checkpoint = dict(iter_weights(folder))
    runner = ModelRunner(folder, dtype="bfloat16", quantization="int8")
    params, weight_bytes = model_weights(runner.model, tied)
    assert params == sum(t.numel() for t in checkpoint.values())
    cfg = runner.model_config
    embedding = cfg.vocab_size * cfg.hidden_size
    norms = sum(t.numel() for n, t in checkpoint.items() if "norm" in n)
    # Every Linear in int8 (tied: a quantized copy of the embedding as the LM head); the
    # embedding table itself is only looked up. One byte per weight and one scale per
    # output feature: on llmbus's kernel in whole blocks of 64 outputs (the padding is read
    # too) with float32 scales, on PyTorch's with bfloat16 ones.
    linears = [m for m in runner.model.modules() if isinstance(m, Int8Linear)]
    matmul = sum(t.numel() for n, t in checkpoint.items() if t.dim() == 2 and "embed_tokens" not in n)
    assert sum(m.num_weights for m in linears) == matmul + (checkpoint["model.embed_tokens.weight"].numel() if tied else 0)
    shapes = [(m.out_features, m.in_features) for m in linears]  # q/k/v and gate/up fused
    kernels = {m.kernel for m in linears}
    assert len(kernels) == 1
    if kernels == {"llmbus"}:
        expected = sum(-(-n // 64) * 64 * (k + 4) for n, k in shapes)
    else:
        expected = sum(n * k + 2 * n for n, k in shapes)
    norms = sum(t.numel() for n, t in checkpoint.items() if "norm" in n)
    assert weight_bytes == expected + 2 * norms


def test_matmul_flops_is_a_plausible_rate():
    flops = matmul_flops(torch.float32, [(64, 64, 64)])
    assert 1e6 < flops < 1e14


def test_bench_throughput_reports_both_engines_and_the_compute_bound(tiny_llama, capsys):
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--num-requests", "4",
                 "--input-len", "8", "16", "--output-len", "4", "8", "--hf-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "ratio llmbus/transformers" in out and "of the compute bound" in out
    llmbus, hf = last_json(out)
    assert llmbus["output_tokens"] == hf["output_tokens"] > 0
    assert llmbus["compute_bound_tok_s"] > 0


def test_bench_throughput_with_lora_path_runs_the_adapters_against_the_base(tiny_llama, tmp_path, capsys):
    """vLLM's --enable-lora --lora-path: the same workload over 2 adapters and on the base
    model, alternated in one run; the adapters' requests really ran on adapters."""
    adapter = build_lora_adapter(tiny_llama, tmp_path / "adapter")
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--num-requests", "4", "--input-len", "8", "16",
                 "--output-len", "4", "8", "--skip-hf", "--enable-lora", "--max-loras", "2",
                 "--lora-path", str(adapter)]) == 0
    out = capsys.readouterr().out
    assert "ratio lora/base" in out and "over 2 adapter(s)" in out
    base, lora = last_json(out)
    assert (base["engine"], lora["engine"]) == ("llmbus", "llmbus+lora")
    assert lora["output_tokens"] == base["output_tokens"] > 0
    assert lora["adapters_run"] == ["lora1", "lora2"]
    assert lora["lora_over_base"] > 0


def test_bench_throughput_refuses_lora_path_without_enable_lora(tiny_llama):
    with pytest.raises(SystemExit, match="--lora-path needs --enable-lora"):
        main(["bench", "throughput", "--model", str(tiny_llama), "--skip-hf", "--lora-path", str(tiny_llama)])


def test_bench_latency_reports_itls_against_the_bandwidth_bound(tiny_llama, capsys):
    assert main(["bench", "latency", "--model", str(tiny_llama), "--num-requests", "2",
                 "--input-len", "8", "--output-len", "6"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["llmbus_itl_ms"] > 0 and result["transformers_itl_ms"] > 0
    assert result["bandwidth_bound_ms"] > 0


def test_benchmarks_time_steps_as_generate_runs_them(tiny_llama):
    """llmbus.bench.latency.step_times (W0's ITL, the GPU figures' step periods) steps in
    one hand-over to the engine's thread, as generate does, not one a step (~0.1 ms each,
    which no generate caller waits for); and the tokens are generate's."""
    from llmbus import LLM, SamplingParams
    from llmbus.bench.latency import step_times

    llm = LLM(str(tiny_llama))
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    want = llm.generate([[5, 6, 7], [9, 3]], params)
    submitted, submit = [], llm.executor.submit
    llm.executor.submit = lambda *args: submitted.append(args) or submit(*args)
    results = llm.add_requests([[5, 6, 7], [9, 3]], [params] * 2)
    times = step_times(llm)
    assert len(submitted) == 1 and len(times) >= 7 and all(t > 0 for t in times)
    assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in want]
    llm.add_requests([[5, 6, 7]], [params])
    assert len(step_times(llm, 3)) == 3 and llm.scheduler.has_unfinished_requests()  # (7 tokens to go)


def test_bench_agreement_of_float32_with_itself_and_with_transformers_is_total(tiny_llama, capsys):
    assert main(["bench", "agreement", "--model", str(tiny_llama), "--dtype", "float32",
                 "--max-tokens", "6"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["identical"] == result["prompts"] == 16
    assert result["matching_prefix_tokens"] == result["tokens"]
    # transformers' float32 on the same chat prompts is the oracle: identical too.
    assert result["transformers"] == {"identical": 16, "matching_prefix_tokens": result["tokens"]}


def test_bench_speculative_compares_every_side_with_none_on_the_same_tokens(tiny_llama, capsys):
    # Float32: the exit status says whether speculation changed any token.
    draft = json.dumps({"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 2})
    assert main(["bench", "speculative", "--model", str(tiny_llama), "--workload", "copy", "--workload", "chat",
                 "--num-requests", "3", "--max-tokens", "24", "--repeat", "2",
                 "--compare", '{"method": "ngram", "num_speculative_tokens": 3}', "--compare", draft]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in out if "rounds)" in line] == ["copy", "chat"]
    sides = [line.split(": ")[0].strip() for line in out if "x off" in line]
    assert sides == ["ngram", f"draft_model:{tiny_llama.name}"] * 2
    # (the model drafting itself: every draft accepted, k + 1 tokens a drafting step but at the ends)
    drafted = [line for line in out if line.strip().startswith("draft_model")]
    assert all("acceptance 1.00 of" in line and "outputs identical" in line for line in drafted), drafted


def test_bench_moe_compares_sparse_dense_and_transformers_on_the_same_tokens(capsys):
    from llmbus.cli.main import main

    assert main(["bench", "moe", "--smoke", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for side in ("sparse", "dense", "transformers"):
        assert f"{side}: decode " in out
    assert "sparse/dense: decode" in out and "sparse/transformers: decode" in out
    assert "decode tokens: sparse, dense and transformers agree" in out


def test_bench_images_times_preprocessing_encoding_and_ttft(capsys):
    from llmbus.cli.main import main

    assert main(["bench", "images", "--smoke", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokenizer replica: " in out and "images/s" in out and "encoder (tower + projector): " in out
    assert "from the encoder cache" in out and "the encoder's share" in out


def test_the_bench_client_reads_an_event_whole_whatever_its_json_holds_raw():
    """Another server's events may hold U+2028 (valid raw in JSON), where httpx's
    aiter_lines would end a line; the bench's reader ends lines at newlines alone, also
    when one arrives split across reads."""
    import asyncio

    from llmbus.bench.streaming_client import sse_data

    events = [{"text": "a\u2028b\x85c"}, {"text": "d\u2029e"}]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events) + "data: [DONE]\n\n"
    raw = body.encode()

    async def read() -> list[str]:
        parts = [raw[i:i + 7] for i in range(0, len(raw), 7)]  # (reads that cut characters and lines)
        transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=_Chunks(parts)))
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", "http://x/") as resp:
                return [data async for data in sse_data(resp)]

    assert asyncio.run(read()) == [json.dumps(e, ensure_ascii=False) for e in events] + ["[DONE]"]


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts

    async def __aiter__(self):
        for part in self.parts:
            yield part


def test_the_instant_runner_answers_as_a_model_runner_would_under_a_real_scheduler():
    """Chunked prefill: no token until the prompt is whole; then one a step, never EOS."""
    from services.scheduler.core.scheduler import Scheduler
    from services.worker.instant_runner import InstantRunner
    from shared.config import SchedulerConfig
    from shared.messages import EngineCoreRequest
    from shared.sampling_params import SamplingParams

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_model_len=256), num_kv_blocks=64,
                          block_size=16, vocab_size=50)
    runner = InstantRunner(vocab_size=50, eos_token_id=7)
    scheduler.add_request(EngineCoreRequest("a", list(range(40)), SamplingParams(max_tokens=5), eos_token_id=7))
    sampled = []
    while scheduler.requests:
        step = scheduler.schedule()
        out = runner.execute(step)
        sampled.append([len(t) for t in out.sampled_token_ids])
        for outputs in scheduler.update_from_output(step, out).values():
            assert all(o.error is None for o in outputs.outputs)
    assert sampled == [[0], [0], [1], [1], [1], [1], [1]]  # 16 + 16 + 8 prompt tokens, then decodes


@pytest.mark.slow
def test_bench_control_plane_streams_through_shards_and_gateways_and_reports_cores(tiny_llama, capsys):
    assert main(["bench", "control-plane", "--model", str(tiny_llama), "--data-parallel-size", "2",
                 "--api-server-count", "2", "--num-requests", "32", "--output-len", "16", "--concurrency", "16",
                 "--step-time-ms", "20"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["failed"] == 0 and report["output_tokens"] == 32 * 16
    assert report["us_per_output_token"]["gateway"] > 0 and report["us_per_output_token"]["scheduler"] > 0
    # (steps of 20 ms fill: more than one stream's token each, on average, prompts included)
    assert report["step_time_ms"] == 20 and report["scheduled_tokens_per_step"] >= 1.5
