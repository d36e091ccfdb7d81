"""Shared test support: a real Prometheus server and a fake vLLM /metrics server."""
