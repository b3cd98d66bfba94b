"""Speculative decoding with a checkpoint's multi-token-prediction layer (`{"method": "mtp"}`,
DeepSeek-V3's, GLM-4.5's and GLM-4.7-Flash's layout): every draft the worker proposes is the one a reference
MTP forward built from transformers' own decoder layer proposes for the same context (the
catch-up's positions, KV and chained drafts held to it), and outputs are exact: greedy equals
transformers through chunked prefill and preemption, seeded sampling with penalties and a
JSON schema equal the run without speculation. A model without such a layer is refused by
name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmbus import LLM, SamplingParams
from shared.config import SpeculativeConfig
from draft_recorder import rank0_runner, recorded
from tiny_models import build_tiny_model, hf_greedy

TEXTS = ["the cat sat on the mat, the cat sat on the mat, the cat", "1 2 3 4 5 1 2 3 4 5 1 2 3",
         "abc abc abc abc", "Paged attention keeps"]
MAX_TOKENS = 24
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def with_mtp_layer(folder: Path, seed: int) -> Path:
    """The tiny checkpoint with an MTP layer past its last one, as DeepSeek-V3 ships it: a
    decoder layer like its last (its tensors drawn around that layer's), enorm, hnorm,
    eh_proj, shared_head.norm and copies of the embedding and the head. Drawn to echo the
    main model somewhat (eh_proj passes the hidden state on, the layer's outputs small), so
    a few drafts are accepted where the model repeats itself: random ones never are."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    last, size = config["num_hidden_layers"], config["hidden_size"]
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    sparse = sorted({int(n.split(".")[2]) for n in weights if ".mlp.experts." in n})
    prefix, before = f"model.layers.{last}.", f"model.layers.{sparse[-1]}."  # (a sparse layer's kind)
    for name in [n for n in weights if n.startswith(before)]:
        tensor = weights[name]
        noise = 0.5 * tensor.std() * torch.randn(tensor.shape, generator=generator) if tensor.dim() > 1 else 0
        scale = 0.3 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        weights[prefix + name[len(before):]] = scale * (tensor + noise)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(size, generator=generator)
    weights[prefix + "eh_proj.weight"] = torch.cat([0.1 * torch.randn(size, size, generator=generator),
                                                    torch.eye(size)], dim=1)
    weights[prefix + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights[prefix + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return folder


class ReferenceMTP:
    """The MTP forward written from the layer's definition with transformers' modules: the
    main model's normed final hidden states, `eh_proj([enorm(embed(t[p+1])); hnorm(h[p])])`,
    the family's decoder layer (layer index N) under a causal mask, the head over
    `shared_head.norm`; each further draft a row fed the layer's previous output."""

    def __init__(self, folder: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        config = self.model.config
        last = config.num_hidden_layers
        weights = {n[len(f"model.layers.{last}."):]: t for n, t in load_file(folder / "model.safetensors").items()
                   if n.startswith(f"model.layers.{last}.")}
        if getattr(config, "mlp_layer_types", None):  # (GLM-4.7-Flash's: the MTP layer is sparse)
            config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
        self.layer = type(self.model.model.layers[-1])(config, last).eval()
        layer = {n: t for n, t in weights.items() if n.split(".")[0] not in (
            "enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")}
        experts = sorted({int(n.split(".")[2]) for n in layer if n.startswith("mlp.experts.")})
        if experts:  # (saved an expert apiece, as transformers saves them; its module holds them stacked)
            def take(e, part):
                return layer.pop(f"mlp.experts.{e}.{part}.weight")

            layer["mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([take(e, "gate_proj"), take(e, "up_proj")]) for e in experts])
            layer["mlp.experts.down_proj"] = torch.stack([take(e, "down_proj") for e in experts])
        self.layer.load_state_dict(layer)
        norm = type(self.model.model.norm)
        self.enorm, self.hnorm, self.head_norm = (norm(config.hidden_size, config.rms_norm_eps) for _ in range(3))
        for module, name in ((self.enorm, "enorm"), (self.hnorm, "hnorm"), (self.head_norm, "shared_head.norm")):
            module.weight.data.copy_(weights[f"{name}.weight"])
        self.eh_proj = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.eh_proj.weight.data.copy_(weights["eh_proj.weight"])

    def _joined(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embedded = self.model.model.embed_tokens(tokens)
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))

    @torch.no_grad()
    def drafts(self, token_ids: list[int], k: int) -> list[int]:
        ids = torch.tensor([token_ids])
        hidden = self.model.model(ids).last_hidden_state[0, :-1]  # (positions 0..n-2)
        rows = self._joined(ids[0, 1:], hidden)
        drafts = []
        for _ in range(k):
            n = len(rows)
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = self.layer(rows[None], attention_mask=mask, position_ids=positions,
                             position_embeddings=self.model.model.rotary_emb(rows[None], positions))
            out = out[0] if isinstance(out, tuple) else out
            drafts.append(int(self.model.lm_head(self.head_norm(out[0, -1])).argmax()))
            rows = torch.cat([rows, self._joined(torch.tensor([drafts[-1]]), out[0, -1:])])
        return drafts


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe", "glm4_moe_lite"])
def mtp_model(request, tmp_path_factory):
    arch = request.param
    return with_mtp_layer(build_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch, seed=3), seed=5)


@pytest.fixture(scope="module")
def prompts(mtp_model):
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer(mtp_model)
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill: the catch-up spans chunks
    {"num_kv_blocks": 7, "enable_prefix_caching": False},  # preemption: a request's rows start again
], ids=["plain", "chunked", "preempted"])
def test_mtp_drafts_are_the_reference_layers_and_greedy_equals_transformers(mtp_model, prompts, options):
    llm = LLM(str(mtp_model), speculative_config=MTP, **options)
    calls = recorded(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got == hf_greedy(mtp_model, prompts, MAX_TOKENS)
    stats = llm.stats()
    assert stats.spec_decode_num_draft_tokens >= 3 * len(prompts)
    assert stats.spec_decode_num_accepted_tokens > 0  # (the rows of accepted drafts read on: held below too)
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0
    reference = ReferenceMTP(mtp_model)
    assert len(calls) >= len(prompts)
    for context, drafts in calls:
        assert drafts == reference.drafts(context, len(drafts)), context
    assert stats.kv_cache_usage == 0


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_mtp_seeded_penalized_and_constrained_outputs_are_those_without_speculation(
        mtp_model, prompts, draft_sample_method):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                             repetition_penalty=1.2, presence_penalty=0.3) for i in range(len(prompts))]
    params[-1] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": schema})

    def run(**options):
        llm = LLM(str(mtp_model), **options)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm.stats()

    without, _ = run()
    with_mtp, stats = run(speculative_config={**MTP, "draft_sample_method": draft_sample_method})
    assert with_mtp == without
    assert stats.spec_decode_num_draft_tokens > 0


def test_mtp_is_refused_by_name_where_a_model_has_no_such_layer(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="LlamaForCausalLM here has no multi-token-prediction layers"):
        LLM(str(tiny_llama), speculative_config=MTP)
    # A config that counts one, a checkpoint that lacks it
    folder = build_tiny_model(tmp_path / "deepseek_v3", "deepseek_v3", seed=3)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"holds no multi-token-prediction layer \(model\.layers\.2\.\*\)"):
        LLM(str(folder), speculative_config=MTP)


def test_vllm_s_older_mtp_method_names_mean_mtp():
    for name in ("deepseek_mtp", "glm4_moe_mtp"):
        assert SpeculativeConfig.of({"method": name}).method == "mtp"
    with pytest.raises(ValueError, match="ngram, draft_model, mtp or eagle3"):
        SpeculativeConfig.of({"method": "medusa"})


@pytest.mark.timeout(600)
def test_two_ranks_draft_with_the_mtp_layer_as_one_rank_does(tmp_path):
    """Under --tensor-parallel-size 2 the MTP layer is cut as the main model's layers are
    (its fusion whole on each rank): every draft the reference layer's, one rank's drafts
    and acceptances, transformers' greedy tokens, each rank holding part of the layer.
    DeepSeek-V3's shape: its latent attention and experts cut (GLM's as other ranks'
    layers are, tests/test_tensor_parallel.py)."""
    from services.tokenizer.tokenizer import Tokenizer

    mtp_model = with_mtp_layer(build_tiny_model(tmp_path / "deepseek_v3", "deepseek_v3", seed=3), seed=5)
    tokenizer = Tokenizer(mtp_model)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    runs, held = [], []
    for size in (1, 2):
        llm = LLM(str(mtp_model), tensor_parallel_size=size, speculative_config=MTP, max_model_len=256)
        calls = recorded(llm)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
            stats = llm.stats()
            runner = rank0_runner(llm)
            held.append(sum(t.numel() for t in runner.proposer.drafter.state_dict().values()))
        finally:
            llm.executor.close()
        runs.append((got, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens))
    assert runs[0] == runs[1]
    assert runs[1][0] == hf_greedy(mtp_model, prompts, MAX_TOKENS) and runs[1][2] > 0
    assert held[1] < 0.85 * held[0]  # (its eh_proj and norms whole on each rank; the rest cut)
    reference = ReferenceMTP(mtp_model)
    assert len(calls) >= len(prompts)
    for context, drafts in calls:  # (the two ranks' run's)
        assert drafts == reference.drafts(context, len(drafts)), context
