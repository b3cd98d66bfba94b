"""Buffers for the CPU kernels on 2 MB pages (kernels/cpu/huge_pages.py): aligned where
huge pages can be asked for, ordinary tensors otherwise, and the same values either way."""

import pytest
import torch

from kernels.cpu import huge_pages


@pytest.fixture(autouse=True)
def fresh_probe():
    huge_pages._madvise.cache_clear()
    yield
    huge_pages._madvise.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_a_large_buffer_starts_on_a_huge_page(dtype):
    if huge_pages._madvise() is None:
        pytest.skip("no transparent huge pages to ask for here")
    numel = (5 << 20) // torch.empty(0, dtype=dtype).element_size() + 3  # 5 MB and a bit
    t = huge_pages.empty(numel, dtype)
    assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(1)  # every byte of it is ours to write
    assert bool((t == 1).all())


def test_small_buffers_and_a_switched_off_probe_give_plain_tensors(monkeypatch):
    small = huge_pages.empty(1000, torch.float32)
    assert small.shape == (1000,) and small.untyped_storage().nbytes() == 4000
    monkeypatch.setenv("LLMBUS_HUGE_PAGES", "0")
    huge_pages._madvise.cache_clear()
    assert huge_pages._madvise() is None
    big = huge_pages.empty(3 << 20, torch.float32)
    assert big.untyped_storage().nbytes() == 12 << 20  # no slack for alignment


def test_consolidate_keeps_every_tensor_and_packs_them_in_one_arena():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 577, generator=gen).bfloat16(), torch.randn(7, generator=gen),
               torch.randn(1024, 1024, generator=gen), torch.randint(0, 9, (5, 3), generator=gen)]
    moved = huge_pages.consolidate(tensors)
    for before, after in zip(tensors, moved):
        assert after.dtype == before.dtype and after.shape == before.shape and after.is_contiguous()
        assert torch.equal(after, before) and after.data_ptr() != before.data_ptr()
        assert after.data_ptr() % 64 == 0
    storages = {t.untyped_storage().data_ptr() for t in moved}
    assert len(storages) == 1  # one arena
