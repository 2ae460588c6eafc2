"""magicdec: fast long-context, large-batch generation with sparse-KV speculative decoding."""

__version__ = "0.1.0"
