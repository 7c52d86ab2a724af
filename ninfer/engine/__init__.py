"""The resident engine: scheduling, KV pages, model execution, sampling, output."""
