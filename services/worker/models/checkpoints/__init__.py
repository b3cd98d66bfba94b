"""Checkpoint formats read at load: FP8 (fp8_weights.py) and the integer quantizations (quantized_weights.py)."""
