"""MiniMax-M2: query/key norms over all heads, a partial rotary, a sigmoid router with a correction
bias."""

from __future__ import annotations

from services.worker.models.families.family import Family

MINIMAX_M2 = Family(
    name="MiniMax-M2",
    architectures=("MiniMaxM2ForCausalLM",),
    served="`MiniMaxM2ForCausalLM` (MiniMax-M2)",
    adds=("OLMoE's query/key norms over all of a token's heads under the usual pre-norms; a partial rotary by "
          "halves (`rotary_dim`, as its checkpoints write it); every layer sparse under Mixtral's names "
          "(`block_sparse_moe`, `w1`/`w3`/`w2`): experts chosen by sigmoid score plus the block's correction bias "
          "(`e_score_correction_bias`, float32), weighed by their scores renormalized - DeepSeek-V3's router "
          "without groups or scaling"),
    cpu="as Mixtral",
    gpu="as Mixtral",
    tests=("minimax_m2",),
    traits=("unclassified", "qk_norm_over_heads", "qk_norm"),
    config_class="minimax_m2",
    weight_names={".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"},
)


FAMILIES = (MINIMAX_M2,)
