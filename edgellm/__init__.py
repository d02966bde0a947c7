"""edgellm: decoder-only LLMs from PyTorch to ARM boards."""

__version__ = "0.1.0"
