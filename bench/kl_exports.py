"""Teacher-forced mean KL(reference export || each export) on the first N ids of a text, each export opened as
`edgellm run` opens it (its own cache type, its own stack), all fed the reference's token ids.

    python bench/kl_exports.py REF EXPORT [EXPORT ...] [--text FILE] [--tokens 512]

Prints per export: mean KL, top-1 agreement with the reference, perplexity of the text. The reference needs
max_seq > N (the ids go in as one prompt, in prefill chunks).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from edgellm.runtime.engine import Engine
from edgellm.runtime.generator import export_tokenizer
from edgellm.runtime.manifest import read_manifest


def logits(directory: Path, ids: list[int]) -> np.ndarray:
    """[len(ids), V] float64 log-probabilities: the export's logits after each prefix of ids."""
    m = read_manifest(directory, verify=False)
    x = Engine.open(directory, m).forward_rows(ids).astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reference", type=Path)
    p.add_argument("exports", type=Path, nargs="+")
    p.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args()
    m = read_manifest(args.reference, verify=False)
    ids = export_tokenizer(args.reference, m).encode(args.text.read_text())[:args.tokens]
    ref = logits(args.reference, ids)
    print(f"{args.reference}: {len(ids)} ids of {args.text.name}, PPL "
          f"{np.exp(-ref[np.arange(len(ids) - 1), ids[1:]].mean()):.3f}")
    for d in args.exports:
        got = logits(d, ids)
        kl = (np.exp(ref) * (ref - got)).sum(-1).mean()
        top1 = (ref.argmax(-1) == got.argmax(-1)).mean()
        ppl = np.exp(-got[np.arange(len(ids) - 1), ids[1:]].mean())
        print(f"{d} (cache {read_manifest(d, verify=False).kv_dtype}): mean KL {kl:.4f}, top-1 {top1:.1%}, "
              f"PPL {ppl:.3f}", flush=True)


if __name__ == "__main__":
    main()
