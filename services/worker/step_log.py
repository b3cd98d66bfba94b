"""LLMBUS_STEP_LOG=FILE: one JSON line per step (phase times and batch shape), to compare
what the worker does offline and served without a tracing backend
(scripts/compare_step_logs.py reads them)."""

from __future__ import annotations

import json
import os

from services.worker.step_inputs import StepInputs


class StepLog:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get("LLMBUS_STEP_LOG")
        return cls(path) if path else None

    def write(self, step_ns: tuple[int, int, int, int], inputs: StepInputs, on_graph: bool, num_sampled: int,
              mask_ns: int, drafts: dict[str, list[int]], sampled: list[list[int]], order: list[str],
              launched_behind: int) -> None:
        """`step_ns`: the step's start, forward, sampling and end (wall-clock ns)."""
        start, forward, sample, end = step_ns
        num_drafts = sum(len(d) for d in drafts.values())
        accepted = sum(len(out) - 1 for rid, out in zip(order, sampled) if rid in drafts and out)
        self._file.write(json.dumps({
            "pid": os.getpid(), "start_ns": start, "prepare_ms": (forward - start) / 1e6,
            "forward_ms": (sample - forward) / 1e6, "sample_ms": (end - sample) / 1e6, "mask_ms": mask_ns / 1e6,
            "tokens": inputs.num_tokens, "reqs": inputs.num_rows,
            "decodes": inputs.num_decodes, "sampled": num_sampled,
            "context": int(inputs.seq_lens.sum()), "graph": on_graph,
            "draft_tokens": num_drafts, "accepted_tokens": accepted, "launched_behind": launched_behind,
        }) + "\n")
