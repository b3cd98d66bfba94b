"""Compare the model runners in an `LLMBUS_STEP_LOG` file: what each process did, and
whether two of them ran the same schedule. The command behind the served-against-offline
analysis in docs/performance/history.md.

    LLMBUS_STEP_LOG=steps.jsonl llmbus serve ... &
    LLMBUS_STEP_LOG=steps.jsonl llmbus bench serve ... --compare-offline MODEL
    python scripts/compare_step_logs.py steps.jsonl

Each process (served worker, offline engine) writes its own lines, told apart by pid.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def summarize(pid: int, steps: list[dict]) -> None:
    wall = (steps[-1]["start_ns"] - steps[0]["start_ns"]) / 1e9
    last = steps[-1]
    wall += (last["prepare_ms"] + last["forward_ms"] + last["sample_ms"]) / 1e3
    busy = sum(s["prepare_ms"] + s["forward_ms"] + s["sample_ms"] for s in steps) / 1e3
    decode_only = [s["forward_ms"] for s in steps if s["decodes"] == s["reqs"]]
    print(f"pid {pid}: {len(steps)} steps, {sum(s['tokens'] for s in steps)} tokens, "
          f"{sum(s['sampled'] for s in steps)} sampled; busy {busy:.1f} s of {wall:.1f} s "
          f"({busy / wall:.1%}); median decode-only forward "
          f"{statistics.median(decode_only) if decode_only else 0:.1f} ms")
    masked = [s["mask_ms"] for s in steps if s.get("mask_ms")]
    if masked:  # structured outputs: filling and applying the grammars' bitmask
        print(f"  bitmask in {len(masked)} steps: median {statistics.median(masked):.2f} ms per step, "
              f"{sum(masked) / 1e3 / busy:.1%} of busy time")


def compare(a: list[dict], b: list[dict]) -> None:
    shape = ("tokens", "reqs", "decodes", "context")
    differing = sum(1 for x, y in zip(a, b) if any(x[k] != y[k] for k in shape))
    differing += abs(len(a) - len(b))
    print(f"schedules: {differing} of {max(len(a), len(b))} steps differ in batch shape")
    if differing == 0:
        ratios = [x["forward_ms"] / y["forward_ms"] for x, y in zip(a, b) if y["forward_ms"] > 0]
        deciles = statistics.quantiles(ratios, n=10)
        print(f"forward time of the same step, first / second process: median {statistics.median(ratios):.2f}, "
              f"10th-90th percentile {deciles[0]:.2f}-{deciles[-1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="the LLMBUS_STEP_LOG file")
    args = parser.parse_args()
    by_pid: dict[int, list[dict]] = collections.defaultdict(list)
    with open(args.log) as f:
        for line in f:
            if line.strip():
                step = json.loads(line)
                by_pid[step["pid"]].append(step)
    for pid, steps in by_pid.items():
        summarize(pid, steps)
    runs = list(by_pid.values())
    if len(runs) == 2:
        compare(*runs)


if __name__ == "__main__":
    main()
