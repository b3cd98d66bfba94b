"""Speculative decoding with an EAGLE-3 head (`{"method": "eagle3", "model": HEAD}`, the
published `LlamaForCausalLMEagle3` layout): every draft the worker proposes is the one a
reference head forward built from transformers' Llama modules proposes for the same context
(the target's layers' inputs it reads, its 2H-wide attention, `fc`, the draft vocabulary
mapped by `d2t`, chained drafts), and outputs are exact: greedy equals transformers through
chunked prefill and preemption, seeded sampling equals the run without speculation. A head
for another model is refused at start-up by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmbus import LLM, SamplingParams
from draft_recorder import recorded
from tiny_models import build_tiny_model, hf_greedy

TEXTS = ["the cat sat on the mat, the cat sat on the mat, the cat", "1 2 3 4 5 1 2 3 4 5 1 2 3",
         "abc abc abc abc", "Paged attention keeps"]
MAX_TOKENS = 24
LAYERS = 4  # (vLLM's default layers for a head: 2, N/2 and N-3 of N, here 2, 2 and 1)


def build_head(folder: Path, target: Path, seed: int, **config) -> Path:
    """A random EAGLE-3 head for `target`: one Llama layer whose q/k/v read 2H, hidden_norm,
    fc (3H -> H), norm, an LM head over half the vocabulary (the even ids: d2t[i] = i)."""
    from safetensors.torch import save_file

    goal = json.loads((target / "config.json").read_text())
    size, vocab = goal["hidden_size"], goal["vocab_size"]
    heads, kv_heads, inner = 4, 2, 96
    head_dim = size // heads
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": size,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inner,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
           "vocab_size": vocab, "draft_vocab_size": vocab // 2, "hidden_act": "silu", "tie_word_embeddings": False,
           **config}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.15):
        return scale * torch.randn(*shape, generator=g)

    weights = {
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * size),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * size),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * size),
        "midlayer.self_attn.o_proj.weight": rand(size, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inner, size), "midlayer.mlp.up_proj.weight": rand(inner, size),
        "midlayer.mlp.down_proj.weight": rand(size, inner),
        "fc.weight": rand(size, 3 * size, scale=0.1), "lm_head.weight": rand(vocab // 2, size, scale=0.5),
        "d2t": torch.arange(vocab // 2), "t2d": torch.arange(vocab) % 2 == 0,
    }
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        weights[f"{norm}.weight"] = 1 + rand(size, scale=0.1)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


class ReferenceHead:
    """The head's forward from transformers' Llama modules: the target's residual stream
    entering layers 2, 2 and 1 joined, `fc`, a LlamaDecoderLayer's norms, attention (its
    q/k/v made 2H wide) and MLP as EAGLE-3 arranges them, `norm`, the head, `d2t`."""

    def __init__(self, target: Path, head: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        self.target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        raw = json.loads((head / "config.json").read_text())
        config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        w = load_file(head / "model.safetensors")
        self.layer = LlamaDecoderLayer(config, 0).eval()
        attention = self.layer.self_attn
        for part in ("q_proj", "k_proj", "v_proj"):
            setattr(attention, part, torch.nn.Linear(2 * config.hidden_size, w[f"midlayer.self_attn.{part}.weight"]
                                                     .shape[0], bias=False))
        self.layer.load_state_dict({n[len("midlayer."):]: t for n, t in w.items()
                                    if n.startswith("midlayer.") and "hidden_norm" not in n})
        self.hidden_norm, self.norm = (LlamaRMSNorm(config.hidden_size, config.rms_norm_eps) for _ in range(2))
        self.hidden_norm.weight.data.copy_(w["midlayer.hidden_norm.weight"])
        self.norm.weight.data.copy_(w["norm.weight"])
        self.fc, self.lm_head, self.d2t = w["fc.weight"], w["lm_head.weight"], w["d2t"]
        self.rotary = LlamaRotaryEmbedding(config)
        n = self.target.config.num_hidden_layers
        self.aux = raw.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]

    def _aux(self, ids: torch.Tensor) -> torch.Tensor:
        model = self.target.model
        hidden, positions = model.embed_tokens(ids[None]), torch.arange(len(ids))[None]
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        entering = []
        for layer in model.layers:
            entering.append(hidden[0])
            hidden = layer(hidden, attention_mask=mask, position_ids=positions,
                           position_embeddings=model.rotary_emb(hidden, positions))
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return torch.cat([entering[i] for i in self.aux], dim=-1)

    @torch.no_grad()
    def drafts(self, token_ids: list[int], k: int) -> list[int]:
        ids = torch.tensor(token_ids)
        previous = self._aux(ids)[:-1] @ self.fc.T  # (positions 0..n-2, read beside the tokens 1..n-1)
        tokens = ids[1:].tolist()
        drafts = []
        for _ in range(k):
            n = len(tokens)
            embedded = self.target.model.embed_tokens(torch.tensor(tokens))
            joined = torch.cat([self.layer.input_layernorm(embedded), self.hidden_norm(previous)], dim=-1)[None]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            attended = self.layer.self_attn(joined, self.rotary(joined, positions), mask)[0]
            hidden = previous[None] + attended
            out = (hidden + self.layer.mlp(self.layer.post_attention_layernorm(hidden)))[0]
            best = int((self.norm(out[-1]) @ self.lm_head.T).argmax())
            drafts.append(best + int(self.d2t[best]))
            tokens.append(drafts[-1])
            previous = torch.cat([previous, out[-1:]])
        return drafts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("eagle3-target"), "llama", seed=4, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return build_head(tmp_path_factory.mktemp("eagle3-head"), target, seed=6)


@pytest.fixture(scope="module")
def prompts(target):
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer(target)
    return [tokenizer.encode(text) for text in TEXTS]


def spec(head: Path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill: the catch-up spans chunks
    {"num_kv_blocks": 7, "enable_prefix_caching": False},  # preemption: a request's rows start again
], ids=["plain", "chunked", "preempted"])
def test_eagle3_drafts_are_the_reference_heads_and_greedy_equals_transformers(target, head, prompts, options):
    llm = LLM(str(target), speculative_config=spec(head), **options)
    calls = recorded(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got == hf_greedy(target, prompts, MAX_TOKENS)
    stats = llm.stats()
    assert stats.spec_decode_num_draft_tokens >= 3 * len(prompts)
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0
    reference = ReferenceHead(target, head)
    assert len(calls) >= len(prompts)
    assert all(d % 2 == 0 for _, drafts in calls for d in drafts)  # (the draft vocabulary: even ids, by d2t)
    for context, drafts in calls:
        assert drafts == reference.drafts(context, len(drafts)), context
    assert stats.kv_cache_usage == 0


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_eagle3_seeded_outputs_are_those_without_speculation(target, head, prompts, draft_sample_method):
    params = [SamplingParams(temperature=0.8, seed=21 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                             presence_penalty=0.4) for i in range(len(prompts))]

    def run(**options):
        llm = LLM(str(target), **options)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm.stats()

    without, _ = run()
    with_head, stats = run(speculative_config={**spec(head), "draft_sample_method": draft_sample_method})
    assert with_head == without
    assert stats.spec_decode_num_draft_tokens > 0


def test_a_head_for_another_model_is_refused_at_start_up_by_name(target, head, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"reads the target's layers \[2, 1, -1\]: three of its 2"):
        LLM(str(tiny_llama), speculative_config=spec(head))  # (2 layers: vLLM's default picks do not exist)
    wider = build_head(tmp_path / "wider", target, seed=1, target_hidden_size=128)
    with pytest.raises(ValueError, match="reads hidden states 128 wide, the target's are 64"):
        LLM(str(target), speculative_config=spec(wider))
    config = json.loads((head / "config.json").read_text())
    other = tmp_path / "other-vocab"
    other.mkdir()
    (other / "model.safetensors").symlink_to(head / "model.safetensors")
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with pytest.raises(ValueError, match="drafts for a vocabulary of 1000 tokens, the target's has"):
        LLM(str(target), speculative_config=spec(other))
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        LLM(str(target), speculative_config=spec(tiny_llama))
    with pytest.raises(ValueError, match="eagle3 takes a `model`"):
        LLM(str(target), speculative_config={"method": "eagle3"})


@pytest.mark.timeout(600)
def test_two_ranks_draft_with_the_head_as_one_rank_does(target, head, prompts):
    """Under --tensor-parallel-size 2 each rank holds the whole head and drafts from the
    target's hidden states, whole on every rank: every draft the reference head's, one
    rank's drafts and acceptances, transformers' greedy tokens."""
    runs = []
    for size in (1, 2):
        llm = LLM(str(target), tensor_parallel_size=size, speculative_config=spec(head), max_model_len=256)
        calls = recorded(llm)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
            stats = llm.stats()
        finally:
            llm.executor.close()
        runs.append((got, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens))
    assert runs[0] == runs[1]
    assert runs[1][0] == hf_greedy(target, prompts, MAX_TOKENS)
    reference = ReferenceHead(target, head)
    assert len(calls) >= len(prompts)
    for context, drafts in calls:  # (the two ranks' run's)
        assert drafts == reference.drafts(context, len(drafts)), context
