"""The host's share of a decode step: what the engine's Python costs a step, apart from
the model's arithmetic. On a GPU with CUDA graphs the forward is one launch and the
device runs apart from the host, so a step lasts the longer of its GPU work and this
host work; the issue's targets (GPU busy >= 80% of a batch-128 step) need the host work
under the GPU's (~1.5 ms for SmolLM2 at batch 128 on an H200).

    python scripts/host_step_times.py [--batch 1 32 128] [--context 512] [--runs 3]

A SmolLM2-shaped config shrunk to 2 layers of 64 (random weights, `load_format="dummy"`,
SmolLM2's tokenizer and vocabulary), so the forward is cheap but every host path is the
real one: scheduling, the runner's input building, sampling's bookkeeping, landing,
detokenizing, with steps overlapped as on a GPU and stepped as `generate` steps them (no
hand-over between steps: LLM.step_while). Each phase is timed around the engine's
own methods; "host" is the step's wall time less the forward and the sampler's
arithmetic (logits, softmax, argmax), which a GPU runs. Prefix caching on, as served by
default. Prints one JSON line per batch size and run (medians over the steady decode
steps).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHRUNK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16}
OUTPUT = 48


def shrunk_smollm2(dest: Path, assets: Path | None = None, vocab_size: int | None = None) -> Path:
    """SmolLM2's tokenizer and config (from `assets`, or the fetched model), shrunk (its
    vocabulary too where `vocab_size` says: the tokenizer's ids past it go unused)."""
    from llmbus.model_fetch import resolve_model

    source = assets or resolve_model("smollm2")
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dest / f.name)
    config = json.loads((source / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **SHRUNK, **({"vocab_size": vocab_size} if vocab_size else {})}))
    return dest


class PhaseTimer:
    """Wall time spent in named methods during one step (wrapping them in place)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)
        ns = self.ns

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                ns[phase] += time.perf_counter_ns() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out = {k: v / 1e6 for k, v in self.ns.items()}
        self.ns.clear()
        return out


def measure(llm, batch: int, context: int, salt: int, profile=None) -> dict[str, float]:
    from llmbus import RequestOutputKind, SamplingParams

    runner, timer = llm.runner, PhaseTimer()
    timer.wrap(llm.scheduler, "schedule", "schedule_ms")
    timer.wrap(llm.scheduler, "update_from_output", "update_ms")
    timer.wrap(llm, "_process", "detokenize_ms")
    timer.wrap(runner.model, "compute_logits", "logits_ms")
    timer.wrap(runner.sampler, "sample", "sampler_ms")
    timer.wrap(runner.sampler, "argmax", "sampler_ms")  # (a step of argmax-only requests)
    vocab = runner.vocab_size
    prompts = [[(salt * 7919 + i * 104729 + j * 31) % (vocab - 200) + 100 for j in range(context)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # (as generate asks)
    llm.add_requests(prompts, [params] * batch)
    rows, last = [], [time.perf_counter_ns()]

    def landed(_finished) -> None:  # after each step, on the engine's thread
        now = time.perf_counter_ns()
        wall, last[0] = (now - last[0]) / 1e6, now
        phases = timer.take()
        t0, t_forward, t_sample, t_end = runner.last_step_ns
        decode_only = all(r.num_computed_tokens >= context for r in llm.scheduler.requests.values())
        if decode_only:
            forward = (t_sample - t_forward) / 1e6
            arithmetic = forward + phases.get("logits_ms", 0.0) + phases.get("sampler_ms", 0.0)
            rows.append({"wall_ms": wall, "host_ms": wall - arithmetic, "prepare_ms": (t_forward - t0) / 1e6,
                         "forward_ms": forward, **phases})
            if profile is not None and len(rows) == 3:  # the steady decode steps
                profile.enable()

    # Stepped as generate steps (every step on the engine's thread, no hand-over between
    # them), so a step's wall time is what a caller of generate waits for it.
    llm.step_while(llm.scheduler.has_unfinished_requests, landed)
    if profile is not None:
        llm.executor.call(profile.disable)
    steady = rows[3:-3]
    return {k: round(statistics.median(r.get(k, 0.0) for r in steady), 3) for k in steady[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens a request")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--assets", type=Path, help="SmolLM2's config.json and tokenizer files (a GPU machine's .gpu_assets/smollm2)")
    parser.add_argument("--no-overlap", action="store_true", help="each step landed before the next (a CPU's default)")
    parser.add_argument("--out", type=Path, help="also write the figures there as host_step_times.json")
    parser.add_argument("--device", default="cpu", help="the runner's device (cuda: the host work of a GPU's steps, "
                        "CUDA graphs and all; its phases then include waits for the GPU)")
    parser.add_argument("--vocab-size", type=int, help="logits this wide (default SmolLM2's 49152): on a CPU the "
                        "logits and their argmax run on the host's cores and push the engine's data out of the caches, "
                        "which a GPU's do not; a narrow vocabulary (2048) comes nearer a GPU host's share")
    parser.add_argument("--cprofile", type=int, metavar="N", default=0,
                        help="profile the largest batch's decode steps (cProfile on the engine's thread): the "
                             "N functions of most own time, printed and written to host_profile.txt in --out")
    args = parser.parse_args()

    from llmbus import LLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = shrunk_smollm2(Path(tmp) / "smollm2-shrunk", args.assets, args.vocab_size)
        # On the CPU even on a GPU machine: the host's work is the same Python either way,
        # and there the forward and sampling are timed apart from it (on a GPU they are
        # asynchronous, so a phase's time would not be its work).
        llm = LLM(str(folder), dtype="float32" if args.device == "cpu" else "bfloat16", load_format="dummy",
                  max_num_seqs=max(args.batch), max_num_batched_tokens=8192, kv_cache_memory_bytes=1 << 30,
                  device=args.device)
        # Steps overlapped, as on a GPU (a CPU does not by default): each decode's input
        # token is read where the step before sampled it, the path whose host work counts.
        llm.runner.overlap_steps = not args.no_overlap
        for run in range(args.runs):
            for batch in args.batch:
                figures = measure(llm, batch, args.context, salt=run * 1000 + batch)
                rows.append({"batch": batch, "context": args.context, "run": run, "device": args.device,
                             "vocab_size": llm.runner.vocab_size, **figures})
                print(json.dumps(rows[-1]), flush=True)
        if args.cprofile:
            profile = cProfile.Profile()
            measure(llm, max(args.batch), args.context, salt=99, profile=profile)
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.cprofile)
            print(text.getvalue(), flush=True)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "host_profile.txt").write_text(text.getvalue())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_step_times.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
