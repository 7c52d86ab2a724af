"""``ninfer-train``: a small qwen3_5-family model with its MTP layer, trained on the Python
standard library's source, written as a Hugging Face checkpoint (docs/training.md)."""
