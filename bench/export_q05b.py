"""Export time and peak memory of a Qwen2.5-0.5B-shaped model (random weights) with the default options.

    python bench/export_q05b.py [-o OUT=/tmp/edgellm-bench/export-q05b] [--granularity layer|model]

Builds the Decoder straight from SHAPES["qwen2.5-0.5b"] (hidden 896, 24 layers, 14/2 heads, ffn 4864,
vocab 151936, tied; 494 M params = 1.98 GB fp32), exports it (max_seq 512, prefill chunk 32, verification
included) and prints wall time and the process's peak RSS. Recorded, not asserted; the target is a peak
under 3x the fp32 weights. Write OUT outside the repository (~2 GB).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import time
from pathlib import Path


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=Path("/tmp/edgellm-bench/export-q05b"))
    parser.add_argument("--granularity", choices=("layer", "model"), default="layer")
    args = parser.parse_args()

    import torch

    from edgellm.export import ExportOptions, export_model
    from edgellm.model import SHAPES, Decoder, ModelConfig

    torch.manual_seed(0)
    t0 = time.perf_counter()
    cfg = ModelConfig.preset_config("qwen2", **SHAPES["qwen2.5-0.5b"])
    model = Decoder(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())
    weights_gb = n_params * 4 / 1e9
    build_s, build_rss = time.perf_counter() - t0, peak_rss_gb()

    shutil.rmtree(args.output, ignore_errors=True)
    shutil.rmtree(args.output.with_name(args.output.name + ".partial"), ignore_errors=True)
    t1 = time.perf_counter()
    manifest = export_model(model, args.output, ExportOptions(granularity=args.granularity))
    export_s = time.perf_counter() - t1
    peak = peak_rss_gb()
    on_disk = sum(f.bytes for f in manifest.files.values()) / 1e9

    print(f"model: qwen2.5-0.5b shape, {n_params / 1e6:.1f} M params, {weights_gb:.2f} GB fp32 "
          f"(built in {build_s:.1f} s, peak RSS {build_rss:.2f} GB)")
    print(f"export ({args.granularity}, max_seq 512, chunk 32): {export_s:.1f} s wall, {on_disk:.2f} GB written")
    print(f"peak RSS: {peak:.2f} GB = {peak / weights_gb:.2f}x the fp32 weights (target < 3x)")
    print(f"worst verification diff: {max(manifest.verification.values()):.2e}")


if __name__ == "__main__":
    main()
