"""Graph layout both export (fp32) and quant (`--format fast`) write, so neither imports the other:
pairing.py (a graph's prefill and decode variants as one graph, S symbolic) and stacking.py (the embedding and
every layer as one graph). onnx + numpy + the runtime; no torch (docs/design.md, "Package layout")."""
