"""Whether a token just appended ends its request: the model's EOS or a stop token id
(from min_tokens on), or a length limit."""

from __future__ import annotations

from services.scheduler.core.request import Request
from shared.messages import FinishReason


def check_stop(request: Request, token_id: int, max_model_len: int) -> tuple[FinishReason | None, int | None]:
    """(finish reason, stop token) if `token_id`, just appended, ends the request, else
    (None, None). Scheduler.update_from_output asks only for a token in
    `request.stop_ids` or at a length limit: keep the two in step."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        # A grammar allows the stop token only where it is complete: it ends a
        # constrained request even with ignore_eos.
        if (
            (not params.ignore_eos or params.structured_outputs is not None)
            and request.eos_token_id is not None
            and token_id == request.eos_token_id
        ):
            return FinishReason.STOP, None
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
    if request.num_output_tokens >= request.max_tokens:
        return FinishReason.LENGTH, None
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None
