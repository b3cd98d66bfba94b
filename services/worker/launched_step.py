"""A step whose work is on the device and whose sampled tokens are not on the host yet.

`ModelRunner.launch` returns one: the forward and the sampling are queued, the copy of
the sampled ids back to the host started, and each request that sampled knows where its
token is on the device, so the next step's inputs read it there. `finish()` waits for
the copy and lands the tokens in the requests' states (steps finish in the order they
were launched), giving the step's `ModelRunnerOutput`. Offline, the engine core finishes a
step only after handing the next one to the runner: on a GPU the host's landing,
scheduling and detokenizing then run while the device computes the next step, instead
of the device waiting for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.request_state import RequestState
from shared.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from services.worker.sample.sampler import Samples


@dataclass(slots=True, eq=False)
class LaunchedStep:
    output: ModelRunnerOutput  # its tokens filled in by finish()
    samples: Samples | None = None
    # (index in the output, row of the samples, state) of each request that sampled
    sampled_states: Sequence[tuple[int, int, RequestState]] = ()
    on_finish: Callable[[LaunchedStep], None] | None = None  # the runner's bookkeeping (its queue of launched steps)
    finished: bool = False
    # The states whose tokens are rows 0, 1, ... of `samples.ids`, where every request
    # sampled one token in order (a decode step's usual case); None otherwise. A next step
    # of the same requests in the same order reads them back as they lie (`fed_back`).
    in_order: list[RequestState] | None = None

    def fed_back(self, states: list[RequestState]) -> torch.Tensor | None:
        """This step's sampled ids in row order, where `states` (the next step's requests,
        in its order) are exactly the requests that sampled them, in the same order: each
        next input is then the token of its own row, one copy on the device instead of a
        gather by places (most steps of a steady decode: the batch and its order hold)."""
        if self.in_order is not None and not self.finished and self.in_order == states:
            return self.samples.ids
        return None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> LaunchedStep:
        return cls(output, finished=True)

    def wait(self) -> None:
        """Until the sampled ids are on the host (their copy landed), from any thread."""
        if self.samples is not None:
            self.samples.wait()

    def finish(self) -> ModelRunnerOutput:
        if not self.finished:
            self.finished = True
            if self.on_finish is not None:
                self.on_finish(self)  # the steps launched before this one finish first
            token_ids, token_logprobs = self.samples.to_host()
            sampled, logprobs = self.output.sampled_token_ids, self.output.logprobs
            for i, row, state in self.sampled_states:
                token_id = token_ids[row]
                state.token_ids.append(token_id)
                state.num_pending -= 1
                if state.num_pending == 0:
                    state.pending_token = None
                sampled[i] = [token_id]
            if self.samples.has_logprobs:
                for i, row, _ in self.sampled_states:
                    if token_logprobs[row] is not None:
                        logprobs[i] = [token_logprobs[row]]
            if not any(logprobs):
                self.output.logprobs = []
        return self.output


def reads_device_tokens_only(requests: dict[str, RequestState], so: SchedulerOutput) -> bool:
    """Whether this step can run beside the launched ones: each request with tokens
    still on the device only feeds its latest one back as a decode, and nothing reads
    its history on the host (penalties count the latest token on the device too, the one
    before it only once it has landed: penalties.py; bad words compare it there:
    bad_words.py)."""
    for rid, n in so.num_scheduled_tokens.items():
        state = requests.get(rid)
        if state is None or not state.num_pending:
            continue
        if (n != 1 or rid in so.num_draft_slots or state.matcher is not None
                or (state.num_pending > 1 and state.sampling_params.needs_output_history)
                or state.num_computed_tokens != len(state.token_ids) + state.num_pending - 1):
            return False
    return True
