"""Simulated vLLM pieces: a /metrics exposition identical in shape to vLLM 0.32's."""
