"""What llmbus knows of one model family, beside the one decoder that runs them all
(models/decoder.py): the architectures it answers to, how transformers fills its config,
its checkpoint's names and tensor fix-ups, the tests that hold it to transformers, and its
row of docs/models/supported_models.md (generated from these records:
scripts/models_doc.py). The decoder and the loader ask a family's record, never an
architecture's name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.worker.models.families.traits import TRAITS


@dataclass(frozen=True)
class Family:
    name: str  # as the docs and the logs name it
    architectures: tuple[str, ...]  # config.json's `architectures` this family serves
    served: str  # docs: the architectures, their checkpoints and the wrappers served as this family
    adds: str  # docs: what the family adds to the decoder
    cpu: str  # docs: what runs where on a CPU (the torch backend)
    gpu: str  # docs: the same on a GPU (the Triton backend)
    # tests/tiny_models.py's names of the tiny random models that hold it to transformers
    tests: tuple[str, ...]
    # what the decoder does differently for it, each a trait other families share (the
    # registry's groups: TRAITS there says what each means)
    traits: tuple[str, ...] = ()
    # transformers' model_type whose config class fills what config.json leaves out (the
    # family's defaults where they are not a Llama's), as transformers reads the folder
    config_class: str | None = None
    # the checkpoint's names for our modules: a weight's name takes the first that it holds, once
    weight_names: Mapping[str, str] = field(default_factory=dict)
    unread: tuple[str, ...] = ()  # checkpoint prefixes transformers leaves unread (MTP modules)
    ungated_acts: tuple[str, ...] = ()  # an ungated MLP's activations (empty: a gated MLP)
    # fix-ups on the checkpoint's tensor stream before names are read, by name
    # (models/checkpoints/tensor_fixups.py)
    tensor_fixups: tuple[str, ...] = ()
    # a decoder saved under a prefix of its own, named in a layout of its own (the LayerNorm
    # decoders'): the prefix taken off, then the first (pattern, replacement) that matches
    checkpoint_prefixes: tuple[str, ...] = ()
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # experts stacked in the transformers class's own [experts, out, in] layout whatever the
    # shapes (transformers converts none on load: Mistral 4's), not read by shape
    stacked_experts_out_in: bool = False
    learned_positions_offset: int | None = None  # learned absolute positions: their row's offset
    # where its config.json departs from the common reading (models/decoder_config.py): rewrites
    # of the raw config before it, by name (models/config_fields/rewrites.py), and the decoder
    # fields the family sets itself, a function of the raw config, over the common reading's
    config_rewrites: tuple[str, ...] = ()
    fields: Callable[[Mapping], dict] | None = None

    def __post_init__(self) -> None:
        if not self.architectures or not self.tests:
            raise ValueError(f"family {self.name!r} needs its architectures and a test row")
        unknown = set(self.traits) - set(TRAITS)
        if unknown:
            raise ValueError(f"family {self.name!r}: unknown traits {sorted(unknown)}")
