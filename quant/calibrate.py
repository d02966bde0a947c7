"""Calibration for `--method awq`: the mean |x| of every input channel of every weight matmul, measured on
the fp32 export itself in onnxruntime (no dataset, no download, no PyTorch).

Tokens: sequences the export samples from BOS (the runtime's Generator, temperature 1, no top-k/top-p,
seeds seed, seed+1, ...), i.e. text from the model's own distribution, which is what it will see at run
time. Sampling, not greedy: greedy text from a small model loops, and a loop covers few channels. Or, with
`--calibration-text FILE`, the start of a text like the user's, tokenized by the export's tokenizer: which head
rows carry the probability (headsplit.py) is where that matters most (SmolLM2, a transformers simulation of the
table rows alone: +0.014 KL at 30 % int8 rows ranked on self-sampled text, +0.007 on English/code text).
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

from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.generator import Generator, export_tokenizer
from edgellm.runtime.manifest import Manifest, read_manifest
from edgellm.runtime.sampling import SamplingParams, StopParams

from .runner import Calibrator

SAMPLED = "sampled from BOS by the fp32 export (temperature 1)"
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
    source: str = ""
    ids: tuple[tuple[int, ...], ...] = ()  # the token sequences themselves (the int8 cache's ranges reuse them)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "sequences": self.sequences, "seed": self.seed,
                "source": self.source or SAMPLED}


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


def text_sequences(directory: Path, text: str | Path, n_tokens: int, length: int | None = None) -> list[list[int]]:
    """The first ~`n_tokens` tokens of a text file, tokenized by the export's tokenizer, in sequences of up to
    `length` (each from a fresh context: BOS in front where the checkpoint's rule puts one)."""
    m = read_manifest(directory, verify=False)
    need(m.tokenizer is not None, f"--calibration-text: {directory} has no tokenizer to read {text} with")
    try:
        body = Path(text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise EdgeError(f"--calibration-text: cannot read {text} as UTF-8 text "
                        f"({getattr(err, 'strerror', None) or err})") from None
    need(body.strip() != "", f"--calibration-text: {text} is empty")
    ids = export_tokenizer(directory, m).encode(body)
    bos = [m.bos_id] if m.add_bos and m.bos_id is not None else []
    step = min(length or MAX_SEQUENCE, m.max_seq) - len(bos)
    sequences = [bos + ids[i:i + step] for i in range(0, min(len(ids), n_tokens), step)]
    return [s for s in sequences if len(s) >= 2]


def calibrate(directory: Path, manifest: Manifest, n_tokens: int, seed: int,
              progress: Callable[[int], None] | None = None, hessians: bool = False,
              text: str | Path | None = None) -> Calibration:
    """Act scales of every weight of the export in `directory` over ~`n_tokens` tokens: sampled by the export
    itself, or the start of `text`."""
    sequences = text_sequences(directory, text, n_tokens) if text is not None else \
        sample_sequences(directory, n_tokens, seed)
    need(bool(sequences), f"--calibration-text: {text} holds fewer than 2 tokens")
    total = sum(map(len, sequences))
    runner = Calibrator(Path(directory), manifest, sample_every=-(-total // SAMPLE_ROWS), sample_rows=SAMPLE_ROWS,
                        hessians=hessians)
    for seq in sequences:
        runner.feed(seq)
        if progress is not None:
            progress(len(seq))
    return Calibration(runner.act_scales(), runner.sampled(), total, len(sequences), seed, runner.hessians(),
                       source=f"the first {total} tokens of {Path(text).name}" if text is not None else SAMPLED,
                       ids=tuple(tuple(s) for s in sequences))
