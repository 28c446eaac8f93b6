"""kvtier: a hierarchical KV cache (GPU → host memory → disk) for LLM inference engines."""

__version__ = "0.1.0"
