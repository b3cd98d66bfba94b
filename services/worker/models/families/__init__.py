"""Each model family's knowledge beside the one decoder that runs them all: the registry of
architectures and the traits they share (registry.py), and each kind of family's config
reading (moe.py, hybrid.py, layer_normed.py, latent_attention.py, gemma.py)."""
