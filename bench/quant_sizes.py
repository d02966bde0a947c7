"""Where the megabytes go: bytes per tensor class of llama.cpp GGUFs and edgellm exports, side by side.

    python bench/quant_sizes.py PATH [PATH ...]     (a .gguf file or an edgellm export directory)

GGUF: every tensor's type and bytes, grouped by (type, role: attn_q, ffn_down, token_embd, ...), plus the
metadata (tokenizer, hyper-parameters: file size minus tensor bytes). edgellm: every initializer of every
graph, counted once per (data file, offset) as stored, grouped by role (the weight's module kind and the
array: codes `.q`, `.scales`/`.scales16`, `.zp`, norms, RoPE tables), plus the files that are not weights
(tokenizer.json, manifest.json, the .onnx protobufs).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import onnx


def gguf_sizes(path: Path) -> Counter:
    from gguf import GGUFReader

    out: Counter = Counter()
    for t in GGUFReader(str(path)).tensors:
        role = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.removesuffix(".weight")
        out[f"{role} {t.tensor_type.name}"] += int(t.n_bytes)
    out["(metadata: tokenizer, hparams)"] = path.stat().st_size - sum(out.values())
    return out


def role(name: str) -> str:
    """layers.3.mlp.down.weight.scales16 -> mlp.down .scales16; layers.3.rope.cos -> rope.cos."""
    base = re.sub(r"^layers\.\d+\.", "", name)
    m = re.match(r"(.*?\.weight)(\..*)?$", base)
    return f"{m.group(1).removesuffix('.weight')} {m.group(2) or '(fp32)'}" if m else base


def export_sizes(directory: Path) -> Counter:
    out: Counter = Counter()
    seen: set[tuple[str, int]] = set()
    for f in sorted(directory.glob("*.onnx")):
        out["(.onnx protobufs)"] += f.stat().st_size
        for t in onnx.load(str(f), load_external_data=False).graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if "location" not in ext:
                continue                      # small: inside the .onnx, counted above
            key = (ext["location"], int(ext.get("offset", 0)))
            if key not in seen:
                seen.add(key)
                out[role(t.name)] += int(ext["length"])
    data = sum(f.stat().st_size for f in directory.glob("*.data"))
    out["(page alignment in .data)"] = data - sum(v for k, v in out.items() if not k.startswith("("))
    for f in directory.iterdir():
        if f.suffix not in (".onnx", ".data") and f.is_file():
            out[f"({f.name})"] += f.stat().st_size
    return out


def main() -> None:
    for arg in sys.argv[1:]:
        path = Path(arg)
        sizes = gguf_sizes(path) if path.suffix == ".gguf" else export_sizes(path)
        print(f"{path}: {sum(sizes.values()) / 1e6:.2f} MB")
        for k, v in sorted(sizes.items(), key=lambda kv: -kv[1]):
            print(f"  {v / 1e6:9.3f} MB  {k}")


if __name__ == "__main__":
    main()
