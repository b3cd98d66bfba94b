"""The scripts a lent GPU runs (scripts/device_check.sh) work before a GPU is at hand: a
broken one would waste a 15-minute lease. Here on CPU, on tiny shapes."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What docs/gpu/latest.json must carry (the GPU worker issue names them).
FIGURES = ["date", "device", "command", "w0_itl_ms_smollm2_bf16", "w1_output_tok_s", "w1_speedup_vs_eager",
           "gpu_busy_fraction_decode_b128", "decode_b1_hbm_fraction_8b", "seeded_draws_same_as_cpu",
           "fused_moe_ms_mixtral_layer_b1", "fused_moe_ms_mixtral_layer_b1_loop", "moe_b1_hbm_fraction",
           "w1_output_tok_s_no_overlap", "w1_overlap_speedup", "w0_itl_ms_smollm2_bf16_no_overlap",
           "decode_b128_step_ms_8b", "gpu_busy_fraction_decode_b128_8b"]


def test_gpu_figures_writes_every_figure(smollm2, tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/gpu_figures.py", "--cpu", "--assets", str(smollm2), "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    assert [key for key in FIGURES if key not in report] == []
    assert report["seeded_draws_same_as_cpu"] is True
    assert report["w1_output_tok_s"] > 0 and report["w0_itl_ms_smollm2_bf16"] > 0
    rounds = report["decode_b128_step_ms_rounds"]  # three rounds a mode; the figure is their median
    assert sorted(rounds) == ["", "_eager", "_no_overlap"] and all(len(r) == 3 for r in rounds.values())
    assert report["decode_b128_step_ms"] == statistics.median(rounds[""])
    assert not (tmp_path / "models").exists()  # the shaped configs are cleaned away


def test_gpu_figures_counts_greedy_cases_apart_from_the_other_checks():
    """greedy_cases is output against transformers only: the overlap checks (host_syncs,
    host_waits) and the float8 kernels' rows (no model) are checks, not greedy cases."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_figures import check_counts

    rows = [{"model": "llama", "case": "batch", "identical": True},
            {"model": "llama", "case": "preemption", "identical": False},
            {"model": "llama", "case": "host_syncs", "identical": True},
            {"model": "llama", "case": "host_waits", "identical": False},
            {"case": "fp8_write", "identical": True},
            {"model": "llama", "case": "note"}]  # (no verdict: not counted)
    assert check_counts(rows) == {"greedy_cases": 2, "greedy_identical": 1, "checks": 5, "checks_passed": 3}


def test_images_gpu_check_passes_on_cpu(tmp_path):
    """Its cases on the Triton backend, interpreted: Qwen2.5-VL's MRoPE rows read by
    rotary_and_cache from the table's scratch rows (one family and one test prompt here, for
    CI's time; the GPU runs every prompt of Gemma 3, Qwen2.5-VL and Qwen3-VL)."""
    result = subprocess.run([sys.executable, "scripts/images_gpu_check.py", "--cpu", "--families", "qwen2_5_vl",
                             "--prompts", "1", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "images_gpu_check.json").read_text())["rows"]
    assert [r["case"] for r in rows if r["identical"]] == ["qwen2_5_vl/plain", "qwen2_5_vl/chunked"]


def test_gpu_check_passes_every_check_on_cpu(tmp_path):
    """The same cases as on the GPU, on CPU: a case that cannot pass (one that checks
    nothing, a broken import) is found here, not in a lease. Two of its models (a dense
    one and the MoE one) run every case's code; the GPU runs all four."""
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu", "--models", "llama_hd16", "qwen3_moe",
                             "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [r for r in rows if r.get("identical") is False or "error" in r] == []
    assert {r["case"] for r in rows} >= {"speculative", "structured_json", "no_overlap", "enforce_eager", "penalized",
                                         "int4_widened_float32", "int4_graphs_vs_eager"}
    assert {r.get("model") for r in rows} >= {"llama_hd16", "qwen3_moe"}


def test_host_step_times_writes_each_batch_phases(smollm2, tmp_path):
    result = subprocess.run([sys.executable, "scripts/host_step_times.py", "--assets", str(smollm2), "--batch", "1", "3",
                             "--context", "40", "--runs", "1", "--vocab-size", "2048", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "host_step_times.json").read_text())
    assert [(r["batch"], r["device"]) for r in rows] == [(1, "cpu"), (3, "cpu")]  # (gpu_figures names keys by device)
    assert {r["vocab_size"] for r in rows} == {2048}
    for row in rows:
        assert 0 < row["host_ms"] < row["wall_ms"]
        assert row["schedule_ms"] > 0 and row["prepare_ms"] > 0 and row["detokenize_ms"] > 0


def test_elementwise_check_compares_and_times_every_shape(tmp_path):
    result = subprocess.run([sys.executable, "scripts/elementwise_check.py", "--cpu", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "elementwise.json").read_text())
    for batch in (1, 4):
        assert report[f"elementwise_bits_equal_tiny_b{batch}"] == 1.0  # bfloat16: the same roundings
        assert report[f"elementwise_us_layer_tiny_b{batch}"] > 0 and report[f"elementwise_us_layer_tiny_b{batch}_torch"] > 0


def test_device_check_calls_only_scripts_that_exist():
    text = (ROOT / "scripts/device_check.sh").read_text()
    assert subprocess.run(["bash", "-n", "scripts/device_check.sh"], cwd=ROOT).returncode == 0
    steps = [line.strip().removeprefix("if ! ").removesuffix("; then") for line in text.splitlines()]
    assert any(line.startswith("step elementwise ") for line in steps)
    assert any(line.startswith("step served ") for line in steps)
    for line in steps:
        if line.startswith("step "):
            target = line.split()[4]  # step NAME SECONDS python3 TARGET ...
            if target == "-m":
                module = line.split()[5]
                assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), line
            else:
                assert (ROOT / target).is_file(), line


def test_served_check_compares_llmbus_serve_with_offline_in_both_modes(tiny_llama, tmp_path):
    """`llmbus serve` twice (the worker overlapping steps, and not), W0 through
    `llmbus bench serve`, offline W0 and greedy tokens against offline's."""
    result = subprocess.run([sys.executable, "scripts/served_check.py", "--cpu", "--assets", str(tiny_llama),
                             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "served.json").read_text())
    assert report["served_greedy_equals_offline"] is True and report["api_server_count"] == 1
    for key in ("served_w0_itl_ms_smollm2_bf16", "served_w0_itl_ms_no_overlap", "offline_w0_itl_ms_smollm2_bf16"):
        assert report[key] > 0, key
    assert report["served_b128_output_tok_s"] > 0 and report["offline_b128_output_tok_s"] > 0
    assert report["served_decode_b128_step_ms"] > 0  # from the worker's step log: steps decoding the whole batch
    assert report["served_over_offline_b128"] == round(
        report["served_b128_output_tok_s"] / report["offline_b128_output_tok_s"], 3)
    assert report["served_minus_offline_itl_ms"] == round(
        report["served_w0_itl_ms_smollm2_bf16"] - report["offline_w0_itl_ms_smollm2_bf16"], 3)
