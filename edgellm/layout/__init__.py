"""Graph-layout helpers shared by export and quant (onnx + numpy + the runtime; no torch):

    pairing.py    a graph's prefill and decode variants merged into one graph (S symbolic)
    stacking.py   the embedding and every layer as one graph (the runtime's 2-runs-per-token path)

Both export (fp32 graphs) and quant (`--format fast` graphs) write paired and stacked graphs; this package
sits beside them so neither imports the other (docs/design.md, "Package layout").
"""
