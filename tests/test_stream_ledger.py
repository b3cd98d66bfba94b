"""The gateway's ledger of its streams: what it resumes after a scheduler restart or a bus
gap, and how a repeated or missing output is told from the next one."""

from services.gateway.shell.stream_ledger import StreamLedger
from shared.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from shared.sampling_params import SamplingParams


def request(request_id: str = "r") -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(seed=3), reply_subject="out.g")


def out(index: int, tokens: list[int], finish=None) -> EngineCoreOutput:
    return EngineCoreOutput("r", tokens, finish, index=index,
                            new_logprobs=[Logprobs([t], [-1.0], 1) for t in tokens])


def test_a_resume_carries_the_tokens_received_apart_from_the_prompt():
    ledger = StreamLedger()
    ledger.submitted(request())
    ledger.received(out(0, [7]))
    ledger.received(out(1, [8]))
    (resumed,) = ledger.resumed()
    assert resumed.resume and resumed.output_token_ids == [7, 8]
    assert resumed.prompt_token_ids == [1, 2, 3] and resumed.sampling_params.seed == 3
    assert resumed.reply_subject == "out.g"


def test_a_repeat_is_trimmed_to_what_is_new():
    ledger = StreamLedger()
    ledger.submitted(request())
    ledger.received(out(0, [7, 8]))
    fresh, gap = ledger.received(out(1, [8, 9, 10]))  # 8 again, then new
    assert not gap
    assert (fresh.index, fresh.new_token_ids, len(fresh.new_logprobs)) == (2, [9, 10], 2)
    assert ledger.received(out(0, [7])) == (None, False)  # all of it had come
    assert ledger.resumed()[0].output_token_ids == [7, 8, 9, 10]


def test_a_gap_asks_for_a_resume_at_most_once_a_second():
    ledger = StreamLedger(resume_every_s=1.0)
    ledger.submitted(request())
    ledger.received(out(0, [7]))
    assert ledger.received(out(3, [10]), now=100.0) == (None, True)
    assert ledger.received(out(4, [11]), now=100.5) == (None, False)  # already asked
    assert ledger.received(out(5, [12]), now=101.2) == (None, True)
    fresh, gap = ledger.received(out(1, [8, 9, 10, 11, 12]), now=101.3)  # the replay
    assert not gap and fresh.new_token_ids == [8, 9, 10, 11, 12]


def test_finished_closed_and_aborted_requests_are_not_resumed():
    ledger = StreamLedger()
    for rid in ("done", "closed", "aborted", "open"):
        ledger.submitted(request(rid))
    ledger.received(EngineCoreOutput("done", [5], FinishReason.STOP, index=0))
    ledger.forget(["closed", "aborted"])
    assert [r.request_id for r in ledger.resumed()] == ["open"]
    assert ledger.resumed(["done", "open"])[0].request_id == "open"
