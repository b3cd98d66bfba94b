"""The C++ CPU kernels (kernels/cpu): decode attention read in place from the paged cache
against attention written out in float64, and the build's fallbacks."""

import ctypes
import shutil
from pathlib import Path

import pytest
import torch

import kernels.cpu as cpu_kernels
from kernels.cpu import build as cpu_build
from llmbus.bench.attention_batches import heads_first, make_batch

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def attention_float64(query, kv_cache, block_table, seq_lens, scale):
    """softmax(q k^T * scale) v for one query token per sequence, GQA by head // group."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        slots = [int(block_table[s, p // block_size]) * block_size + p % block_size for p in range(n)]
        k = kv_cache[0].flatten(0, 1)[slots].double()
        v = kv_cache[1].flatten(0, 1)[slots].double()
        for h in range(num_heads):
            scores = k[:, h // group] @ query[s, h].double() * scale
            out[s, h] = scores.softmax(0) @ v[:, h // group]
    return out


# How close each dtype's output must come to attention in float64: bfloat16 keeps 8
# significant bits; float32 sums in float32 and its exp is good to ~2e-7.
DECODE_TOLERANCE = {torch.bfloat16: dict(atol=4e-3, rtol=2**-7), torch.float32: dict(atol=1e-5, rtol=1e-5)}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("layout", ["token-major", "heads-first"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 4, 64), (9, 3, 64), (8, 1, 128), (6, 2, 128),
                                                              (4, 1, 256), (8, 4, 256)])  # Gemma's
def test_decode_attention_matches_float64(layout, num_heads, num_kv_heads, head_dim, dtype):
    # Lengths on and off block and 16-lane boundaries, one past 1000 tokens.
    seq_lens = [1, 15, 16, 17, 100, 1037]
    query, kv_cache, md = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, 16,
                                     dtype, seed=num_heads + head_dim)
    cache = heads_first(kv_cache) if layout == "heads-first" else kv_cache
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(query, cache, md.block_table, md.seq_lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    expected = attention_float64(query, kv_cache, md.block_table, md.seq_lens, scale)
    torch.testing.assert_close(out.double(), expected, **DECODE_TOLERANCE[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("seq_lens", [[1037], [15, 100]], ids=["one", "two"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (6, 2, 128)])
def test_decode_attention_of_a_few_streams_matches_float64(seq_lens, num_heads, num_kv_heads, head_dim, dtype):
    """Fewer sequences than twice the threads: each KV head is a task of its own."""
    query, kv_cache, md = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, 16,
                                     dtype, seed=len(seq_lens))
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(query, heads_first(kv_cache), md.block_table, md.seq_lens, scale)
    expected = attention_float64(query, kv_cache, md.block_table, md.seq_lens, scale)
    torch.testing.assert_close(out.double(), expected, **DECODE_TOLERANCE[dtype])


@needs_kernels
def test_decode_attention_survives_peaked_and_flat_scores():
    """A huge scale puts all weight on one key (no overflow in exp), a zero query spreads it
    evenly (the mean of the values)."""
    query, kv_cache, md = make_batch([1, 1], [40, 300], 6, 2, 64, 16, torch.bfloat16, seed=11)
    peaked = cpu_kernels.paged_decode_attention(query, kv_cache, md.block_table, md.seq_lens, 1e4)
    expected = attention_float64(query, kv_cache, md.block_table, md.seq_lens, 1e4)
    assert torch.isfinite(peaked.float()).all()
    torch.testing.assert_close(peaked.double(), expected, atol=4e-3, rtol=2**-7)
    flat = cpu_kernels.paged_decode_attention(torch.zeros_like(query), kv_cache, md.block_table, md.seq_lens, 1.0)
    expected = attention_float64(torch.zeros_like(query), kv_cache, md.block_table, md.seq_lens, 1.0)
    torch.testing.assert_close(flat.double(), expected, atol=4e-3, rtol=2**-7)


@needs_kernels
def test_decode_attention_refuses_what_it_cannot_read():
    query, kv_cache, md = make_batch([1], [20], 4, 2, 64, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        cpu_kernels.paged_decode_attention(query.half(), kv_cache.half(), md.block_table, md.seq_lens, 0.1)
    with pytest.raises(ValueError, match="same dtype"):
        cpu_kernels.paged_decode_attention(query.float(), kv_cache, md.block_table, md.seq_lens, 0.1)
    assert not cpu_kernels.attention_supported(query.float(), kv_cache)
    with pytest.raises(ValueError, match="int32"):
        cpu_kernels.paged_decode_attention(query, kv_cache, md.block_table.long(), md.seq_lens, 0.1)
    odd_query, odd_cache, md = make_batch([1], [20], 4, 2, 96, 16, torch.bfloat16)
    assert not cpu_kernels.attention_supported(odd_query, odd_cache)
    with pytest.raises(ValueError, match="head_dim 96"):
        cpu_kernels.paged_decode_attention(odd_query, odd_cache, md.block_table, md.seq_lens, 0.1)


@needs_kernels
def test_linear_refuses_a_weight_of_another_shape():
    packed = cpu_kernels.pack_weight(torch.randn(100, 64).bfloat16())
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.linear(torch.randn(3, 32).bfloat16(), packed, 100)
    with pytest.raises(ValueError, match="even"):
        cpu_kernels.pack_weight(torch.randn(8, 63).bfloat16())


@needs_kernels
def test_the_library_shares_pytorchs_openmp_runtime():
    """Two OpenMP runtimes in one process would each keep a thread per core spinning."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_the_kernels_build_where_the_cpu_and_a_compiler_allow():
    """Every kernel test skips when the library does not load, so a source that stops
    compiling would otherwise pass as skips: where this CPU and a compiler allow a build,
    it must load."""
    import os

    if os.environ.get("LLMBUS_CPU_KERNELS", "1") == "0":
        pytest.skip("LLMBUS_CPU_KERNELS=0")
    if not set(cpu_build.REQUIRED_CPU_FLAGS) <= cpu_build.cpu_flags():
        pytest.skip("this CPU lacks AVX-512 BF16")
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler")
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


@needs_kernels  # (where nothing builds, the reason was the point: the test above)
def test_build_says_why_it_did_not(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMBUS_HOME", str(tmp_path))
    monkeypatch.setenv("LLMBUS_CPU_KERNELS", "0")
    assert cpu_build.build_library() == (None, "LLMBUS_CPU_KERNELS=0")
    monkeypatch.delenv("LLMBUS_CPU_KERNELS")
    lib, reason = cpu_build.build_library(compiler="/bin/false")  # a compiler that fails
    assert lib is None and "failed" in reason
    assert not list((tmp_path / "kernels").iterdir())  # no half-built file left behind


@needs_kernels
def test_a_built_library_is_reused_and_a_changed_source_rebuilds(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMBUS_HOME", str(tmp_path))
    # The library this session built, in a home of its own: found by its name, not rebuilt
    # (a compile takes a core ~17 s; the changed sources below cost one).
    built = Path(cpu_kernels.library.load()[0]._name)
    (tmp_path / "kernels").mkdir()
    shutil.copy2(built, tmp_path / "kernels" / built.name)
    before = (tmp_path / "kernels" / built.name).stat().st_mtime_ns
    lib, _ = cpu_build.build_library()
    assert isinstance(lib, ctypes.CDLL) and Path(lib._name).name == built.name
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built.name]
    assert (tmp_path / "kernels" / built.name).stat().st_mtime_ns == before
    # Another source set (copied, one comment changed) gets its own library.
    sources = tmp_path / "src"
    sources.mkdir()
    for path in cpu_build.SOURCE_DIR.glob("*.[ch]*"):
        if path.suffix in (".cpp", ".h"):
            (sources / path.name).write_text(path.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", sources)
    assert cpu_build.build_library()[0] is not None
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 2
    assert not [p for p in (tmp_path / "kernels").iterdir() if p.suffix != ".so"]  # the objects went with their folder


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize("rotary_dim", [0, 24], ids=["whole", "partial"])
def test_rotary_kernel_gives_pytorchs_bits_in_place(monkeypatch, num_tokens, dtype, rotary_dim):
    """Query and key heads inside a wider fused qkv row, rotated in place, against the
    PyTorch ops on a copy; a partial rotary (a half of 12: a masked vector) keeps the rest
    of each head."""
    from services.worker.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(num_tokens)
    rope = RotaryEmbedding(64, 4096, 10000.0, {}, rotary_dim)
    qkv = torch.randn(num_tokens, (9 + 3 + 3) * 64, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    qk = qkv[:, : 12 * 64].unflatten(-1, (12, 64))
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "supports", lambda x: False)
        expected = rope(positions, qk.clone())
    untouched = qkv[:, 12 * 64 :].clone()
    out = rope(positions.clone(), qk)
    assert out.data_ptr() == qk.data_ptr()  # in place
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, 12 * 64 :], untouched)  # the value heads are left alone
    with pytest.raises(IndexError, match="past the rotary table"):
        rope(torch.tensor([4096] * num_tokens), qk)


GATES = {"silu": torch.nn.functional.silu,
         "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}


@needs_kernels
@pytest.mark.parametrize("activation", GATES)
@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_act_and_mul_kernel_matches_pytorch(num_tokens, activation):
    gen = torch.Generator().manual_seed(num_tokens)
    gate_up = (torch.randn(num_tokens, 2 * 1536, generator=gen) * 6).bfloat16()
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -3e38, 3e38]).bfloat16()  # exp's range ends, g^3 past it
    gate_up[0, 6:14] = torch.tensor([1e-3, -1e-3, 0.5, -0.5, 2.0, -2.0, 5.0, -5.0]).bfloat16()  # the curve's bend
    gate, up = gate_up.split(1536, dim=-1)
    act = GATES[activation]
    # float32: the exponential's last bits differ from PyTorch's, a few roundings at most:
    # of SiLU's value; of g * up for GELU, whose 1 + tanh(y) loses its own bits below g = -4
    # in both (the bfloat16 check below holds it to PyTorch's there).
    out32 = cpu_kernels.act_and_mul(gate_up.float(), activation)
    assert out32.dtype == torch.float32
    expected32 = act(gate.float()) * up.float()
    if activation == "silu":
        torch.testing.assert_close(out32, expected32, rtol=2.0**-20, atol=1e-30)
    else:
        near = (out32 - expected32).abs() <= 2.0**-21 * (gate.float() * up.float()).abs()
        assert bool((near | (out32 == expected32)).all())  # (== for the infinities)
    out = cpu_kernels.act_and_mul(gate_up, activation)
    expected = act(gate) * up
    differ = out != expected
    assert int(differ.sum()) <= max(2, differ.numel() // 1000)  # exp's last bits, rarely visible
    relative = (out.float() - expected.float()).abs() / expected.float().abs().clamp_min(1e-30)
    assert float(torch.where(differ, relative, 0.0).max()) <= 2.0**-6


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("layout", ["token-major", "heads-first"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 4, 64), (9, 3, 64), (8, 1, 64), (6, 2, 128),
                                                              (4, 1, 256)])
@pytest.mark.parametrize("query_len, seq_len", [(1, 1), (7, 7), (33, 33), (100, 100), (5, 40), (70, 301)])
def test_prefill_attention_matches_float64(layout, num_heads, num_kv_heads, head_dim, query_len, seq_len, dtype):
    """Whole prompts and chunks that start mid-sequence (the cached prefix visible to all,
    causal among the new tokens); lengths on and off the 16-key tiles and 32-token tasks."""
    query, kv_cache, md = make_batch([query_len], [seq_len], num_heads, num_kv_heads, head_dim, 16, dtype,
                                     seed=query_len + seq_len + head_dim)
    cache = heads_first(kv_cache) if layout == "heads-first" else kv_cache
    scale = head_dim**-0.5
    out = cpu_kernels.paged_prefill_attention(query, cache, md.block_table[0], seq_len, scale)
    expected = torch.empty(query.shape, dtype=torch.float64)
    group = num_heads // num_kv_heads
    slots = [int(md.block_table[0, p // 16]) * 16 + p % 16 for p in range(seq_len)]
    k = kv_cache[0].flatten(0, 1)[slots].double()
    v = kv_cache[1].flatten(0, 1)[slots].double()
    for t in range(query_len):
        visible = seq_len - query_len + t + 1
        for h in range(num_heads):
            scores = k[:visible, h // group] @ query[t, h].double() * scale
            expected[t, h] = scores.softmax(0) @ v[:visible, h // group]
    assert out.dtype == dtype
    # bfloat16 rounds the probabilities for the weighted sum (as flash-attention does);
    # float32 keeps them.
    tolerance = dict(atol=1e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), expected, **tolerance)


@needs_kernels
def test_prefill_attention_refuses_what_it_cannot_read():
    query, kv_cache, md = make_batch([8], [20], 4, 2, 64, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="covering"):
        cpu_kernels.paged_prefill_attention(query, kv_cache, md.block_table[0, :1].contiguous(), 20, 0.1)
    with pytest.raises(ValueError, match="8 new of 5"):
        cpu_kernels.paged_prefill_attention(query, kv_cache, md.block_table[0], 5, 0.1)


@needs_kernels
def test_the_kernel_benchmark_script_runs():
    """scripts/cpu_kernels_bench.py, behind docs/performance/history.md's kernel figures, still runs."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "cpu_kernels_bench.py"
    result = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for what in ("1 rows: llmbus", "2048 rows: llmbus", "decode attention", "prefill attention"):
        assert what in result.stdout
    gemma = subprocess.run([sys.executable, str(script), "--quick", "--attention-only", "--heads", "4,1,256"],
                           capture_output=True, text=True, timeout=300)
    assert gemma.returncode == 0 and "decode attention" in gemma.stdout and "rows: llmbus" not in gemma.stdout, gemma
