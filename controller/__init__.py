"""sd-controller: switch speculative decoding on a vLLM server on and off as load changes."""

__version__ = "0.1.0"
