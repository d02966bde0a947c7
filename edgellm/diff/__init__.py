"""Accuracy reports: PyTorch vs exported (and quantized) graphs, per layer, per position, per greedy token.

`run.run_diff(loaded, checkpoint, export_dirs, DiffOptions) -> report dict`, `writer.write_report(report, dir)`
(report.json + report.html, atomically), `report_json.load_report(path)`, `gate.parse_gate("kl>0.05")`.
Nothing is imported here: `edgellm --help` loads `gate` for its metric list and must not pull in torch.
"""
