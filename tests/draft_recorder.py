"""What a model drafter proposes, recorded as it proposes it (tests/test_mtp.py,
tests/test_eagle3.py hold each proposal to a reference forward)."""


def rank0_runner(llm):
    """The LLM's model runner: rank 0's, behind a tensor-parallel group's front."""
    return getattr(llm.runner, "runner", llm.runner)


def recorded(llm) -> list[tuple[list[int], list[int]]]:
    """Every (context, drafts) the worker's proposer gives from now on, as it gives them
    (rank 0's, under tensor parallelism)."""
    proposer, calls = rank0_runner(llm).proposer, []
    propose = proposer.propose

    def record(requests, slots, *args):
        drafts = propose(requests, slots, *args)
        calls.extend((list(requests[rid].token_ids), d) for rid, d in drafts.items())
        return drafts

    proposer.propose = record
    return calls
