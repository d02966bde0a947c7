"""Calibration for `--method awq`: the mean |x| of every input channel of every weight matmul, measured on
the fp32 export itself in onnxruntime (no dataset, no download, no PyTorch).

Tokens: sequences the export samples from BOS (the runtime's Generator, temperature 1, no top-k/top-p,
seeds seed, seed+1, ...), i.e. text from the model's own distribution, which is what it will see at run
time. Sampling, not greedy: greedy text from a small model loops, and a loop covers few channels.
Capture: `runner.Calibrator` runs the export through the runtime's Engine and reads the A input of every weight
MatMul from a copy of each graph (a probe), sums |x| over the real (unpadded) rows and keeps up to SAMPLE_ROWS rows, evenly
spaced over the tokens, for AWQ's scale search (awq.py).

Uses: mean |x| weights the clip search (methods.py `mse` with act_scale minimises
sum_k (mean|x_k|)^2 * (W - Wq)[:, k]^2, the output error for independent channels) and is the base of AWQ's
per-channel scales s = mean|x|^alpha; the kept rows measure the true output error ||X (W - Wq)^T||^2 of
each alpha tried (awq.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgellm.runtime.generator import Generator
from edgellm.runtime.manifest import Manifest
from edgellm.runtime.sampling import SamplingParams, StopParams

from .runner import Calibrator

MAX_SEQUENCE = 128   # tokens per calibration sequence (capped by max_seq): several stories, not one long one
SAMPLE_ROWS = 256    # input rows kept per weight for AWQ's scale search (256 x K float32 each)


@dataclass(frozen=True)
class Calibration:
    act_scales: dict[str, np.ndarray]   # weight initializer -> mean |x| [K] float32
    samples: dict[str, np.ndarray]      # weight initializer -> input rows [<= SAMPLE_ROWS, K] float32
    tokens: int
    sequences: int
    seed: int
    hessians: dict[str, np.ndarray] = field(default_factory=dict)   # weight -> X^T X [K, K] (GPTQ)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "sequences": self.sequences, "seed": self.seed,
                "source": "sampled from BOS by the fp32 export (temperature 1)"}


def sample_sequences(directory: Path, n_tokens: int, seed: int, length: int | None = None) -> list[list[int]]:
    """Sequences of up to `length` tokens (BOS first) sampled by the export until `n_tokens` are collected."""
    gen = Generator.open(directory, verify=False)
    m = gen.manifest
    length = min(length or MAX_SEQUENCE, m.max_seq)
    start = [m.bos_id if m.bos_id is not None else 0]
    params = SamplingParams(temperature=1.0)
    sequences: list[list[int]] = []
    total = 0
    while total < n_tokens:
        want = min(length, n_tokens - total + 1)
        if want < 2:
            break
        result = gen.complete(start, params, StopParams(max_new_tokens=want - 1, seed=seed + len(sequences)),
                              ignore_eos=True)
        seq = start + result.token_ids
        sequences.append(seq)
        total += len(seq)
    return sequences


def calibrate(directory: Path, manifest: Manifest, n_tokens: int, seed: int,
              progress: Callable[[int], None] | None = None, hessians: bool = False) -> Calibration:
    """Act scales of every weight of the export in `directory` over ~`n_tokens` sampled tokens."""
    sequences = sample_sequences(directory, n_tokens, seed)
    total = sum(map(len, sequences))
    runner = Calibrator(Path(directory), manifest, sample_every=-(-total // SAMPLE_ROWS), sample_rows=SAMPLE_ROWS,
                        hessians=hessians)
    for seq in sequences:
        runner.feed(seq)
        if progress is not None:
            progress(len(seq))
    return Calibration(runner.act_scales(), runner.sampled(), total, len(sequences), seed, runner.hessians())
