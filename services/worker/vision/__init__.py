"""Images in the worker: each family's vision encoder (gemma3.py), the encoder cache by
image (encoder.py), and a step's image embeddings in place of their placeholders
(step_images.py)."""
