"""Readers of a Hugging Face model folder's files other than the weights: generation_config.json, pooling, classification."""
