"""A step's flattened inputs (services/worker/step_inputs.py): the path for steps of
decodes only gives exactly what the path for any step gives on the same requests."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.block_table import BlockTable
from services.worker.request_state import RequestState
from services.worker.step_inputs import StepInputs
from shared.sampling_params import SamplingParams

BLOCK_SIZE = 4


@st.composite
def decode_steps(draw):
    """Requests each decoding one token: of a token the host knows, or (steps overlapped)
    of one a launched step sampled, still on the device; a block table row each."""
    table = BlockTable(max_blocks_per_request=16, num_rows=2)  # (grows as rows are taken)
    states = []
    for i in range(draw(st.integers(1, 12))):
        known = draw(st.integers(1, 40))
        pending = draw(st.integers(0, 2))
        computed = draw(st.integers(0, known + pending - 1))
        blocks = draw(st.lists(st.integers(0, 500), min_size=computed // BLOCK_SIZE + 1,
                               max_size=computed // BLOCK_SIZE + 3))
        state = RequestState(req_id=f"r{i}", token_ids=draw(st.lists(st.integers(0, 999), min_size=known,
                                                                       max_size=known)),
                             num_prompt_tokens=1, sampling_params=SamplingParams(temperature=0), eos_token_id=None,
                             block_row=table.add(blocks), num_computed_tokens=computed,
                             long_rope=draw(st.booleans()), num_pending=pending)
        state.pending_token = ("step", i) if pending else None  # (where its token is on the device)
        states.append(state)
    long_offset = draw(st.one_of(st.none(), st.integers(1, 64)))
    return states, table, long_offset


def _assert_same(a, b) -> None:
    inputs_a, rows_a, last_a, device_a = a
    inputs_b, rows_b, last_b, device_b = b
    for field in StepInputs.__slots__:
        x, y = getattr(inputs_a, field), getattr(inputs_b, field)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), field
        else:
            assert x == y, field
    assert rows_a == rows_b and device_a == device_b
    assert last_a.dtype == last_b.dtype and (last_a == last_b).all()


@settings(max_examples=200, deadline=None)
@given(decode_steps())
def test_the_decodes_path_gives_what_the_path_for_any_step_gives(step):
    states, table, long_offset = step
    num_tokens = {s.req_id: 1 for s in states}
    per_state = np.array([(s.num_computed_tokens, 1, len(s.token_ids), s.num_pending, s.block_row) for s in states],
                         np.int64)
    decodes = StepInputs._decodes(states, per_state, BLOCK_SIZE, table, long_offset)
    _assert_same(decodes, StepInputs._any_rows(states, per_state, {}, BLOCK_SIZE, table, long_offset))
    _assert_same(decodes, StepInputs.build(states, num_tokens, {}, BLOCK_SIZE, table, long_offset))


def test_build_takes_the_decodes_path_only_for_one_token_a_request(monkeypatch):
    table = BlockTable(max_blocks_per_request=8)
    states = [RequestState(req_id=f"r{i}", token_ids=list(range(10)), num_prompt_tokens=10,
                           sampling_params=SamplingParams(temperature=0), eos_token_id=None,
                           block_row=table.add([2 * i, 2 * i + 1, 9]), num_computed_tokens=9) for i in range(3)]
    taken = []
    decodes = StepInputs._decodes.__func__

    def spy(cls, *args):
        taken.append(True)
        return decodes(cls, *args)

    monkeypatch.setattr(StepInputs, "_decodes", classmethod(spy))
    StepInputs.build(states, {s.req_id: 1 for s in states}, {}, BLOCK_SIZE, table)
    assert taken == [True]
    states[1].num_computed_tokens = 6  # (a chunk of 4: this step is not decodes only)
    inputs, *_ = StepInputs.build(states, {"r0": 1, "r1": 4, "r2": 1}, {}, BLOCK_SIZE, table)
    assert taken == [True] and inputs.num_tokens == 6
