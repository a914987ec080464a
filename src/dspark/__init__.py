"""dspark: lossless speculative decoding (DSpark) for LLMs."""

__version__ = "0.1.0"
