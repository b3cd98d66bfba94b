"""A model runner with no model, for measuring the control plane: each step is answered at
once with a token for every request whose prompt the step completes (none for a prefill
chunk with more to come), as the real runner answers, so the scheduler, the bus and the
gateways do all their real work while the worker costs nothing (`llmbus bench
control-plane`). Its tokens are a fixed function of the request's length: greedy-like,
never the EOS."""

from __future__ import annotations

from shared.messages import ModelRunnerOutput, SchedulerOutput


class InstantRunner:
    def __init__(self, vocab_size: int, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.num_tokens: dict[str, int] = {}  # request id -> its prompt and output tokens

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if step.reset:
            self.num_tokens.clear()
        for req_id in step.finished_req_ids:
            self.num_tokens.pop(req_id, None)
        computed: dict[str, int] = {}
        for new in step.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = step.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids, sampled = [], []
        for req_id, num in step.num_scheduled_tokens.items():
            total = self.num_tokens.get(req_id)
            if total is None:
                continue
            req_ids.append(req_id)
            if computed.get(req_id, 0) + num >= total:
                self.num_tokens[req_id] = total + 1
                sampled.append([self._token(total)])
            else:
                sampled.append([])
        return ModelRunnerOutput(step.step_id, req_ids, sampled)

    def _token(self, position: int) -> int:
        token = (position * 7919) % self.vocab_size
        return (token + 1) % self.vocab_size if token == self.eos_token_id else token
