"""NVIDIA's Nemotron-H: blocks of one branch each (Mamba2, attention without positions, or an
ungated relu2 MLP)."""

from __future__ import annotations

from services.worker.models.families.family import Family

NEMOTRON_H = Family(
    name="Nemotron-H",
    architectures=("NemotronHForCausalLM",),
    config_rewrites=("nemotron_h",),
    served="`NemotronHForCausalLM` (Nemotron-H-8B/47B/56B, NVIDIA-Nemotron-Nano-9B-v2, -12B-v2)",
    adds=("blocks of one branch each, as `hybrid_override_pattern` (or `layers_block_type`) lays them out: Mamba2 "
          "(M, as Granite 4.0-H's), attention without positions (*), or an ungated relu2 MLP (-), each behind its "
          "own norm (`ModelConfig.mixerless_layers`, `mlpless_layers`: an MLP block has no token mixer and no "
          "cache, a mixer block no MLP); its checkpoints' `backbone.*` names (`embeddings`, `norm_f`, a block's "
          "`mixer`) read; its mixture-of-experts blocks (Nemotron 3's E) refused by name"),
    cpu="as Granite 4.0-H (the MLP in PyTorch)",
    gpu="as Granite 4.0-H",
    tests=("nemotron_h",),
    traits=("mamba", "unclassified"),
    config_class="nemotron_h",
    ungated_acts=("relu2",),
    tensor_fixups=("nemotron_h",),
)


FAMILIES = (NEMOTRON_H,)
