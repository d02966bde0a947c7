"""Decoder -> ONNX graphs with a static KV cache + manifest.json, verified against PyTorch."""

from .exporter import export_model
from .options import ExportOptions

__all__ = ["ExportOptions", "export_model"]
