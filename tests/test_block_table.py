"""The worker's persistent block table: rows appended by deltas, reused, grown."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker.block_table import BlockTable


def test_a_step_gathers_each_requests_blocks_appended_by_deltas():
    table = BlockTable(max_blocks_per_request=6, num_rows=4)
    a, b = table.add([3, 4]), table.add([9])
    table.append(b, [10, 11])
    table.append(a, [])
    table.append(a, [5])
    assert table.block_ids(a) == [3, 4, 5] and table.block_ids(b) == [9, 10, 11]
    np.testing.assert_array_equal(table.gather(np.array([b, a])), [[9, 10, 11], [3, 4, 5]])
    c = table.add([7])
    # The width is the most blocks of the rows gathered; a shorter row is zeros past its own.
    np.testing.assert_array_equal(table.gather(np.array([c, a])), [[7, 0, 0], [3, 4, 5]])


def test_a_freed_row_is_reused_with_none_of_its_old_ids():
    table = BlockTable(max_blocks_per_request=4, num_rows=2)
    a = table.add([1, 2, 3])
    table.free(a)
    assert table.num_rows_in_use == 0
    again = table.add([8])
    assert again == a
    np.testing.assert_array_equal(table.table[again], [8, 0, 0, 0])


def test_the_table_grows_when_every_row_is_taken_and_keeps_what_it_held():
    table = BlockTable(max_blocks_per_request=3, num_rows=2)
    rows = [table.add([i, i + 100]) for i in range(5)]
    assert len(set(rows)) == 5 and table.num_rows_in_use == 5
    assert [table.block_ids(r) for r in rows] == [[i, i + 100] for i in range(5)]
    for row in rows:
        table.free(row)
    assert table.num_rows_in_use == 0


def test_more_blocks_than_a_request_may_hold_is_an_error_and_changes_nothing():
    table = BlockTable(max_blocks_per_request=3, num_rows=1)
    row = table.add([1, 2])
    with pytest.raises(ValueError, match="more than max_model_len allows"):
        table.append(row, [3, 4])
    assert table.block_ids(row) == [1, 2]
