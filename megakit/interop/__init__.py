"""Weights in and out: megakit's safetensors checkpoints (any TP/PP layout) and Hugging Face
transformers' layout."""
