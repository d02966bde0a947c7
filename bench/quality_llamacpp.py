"""The llama.cpp side of `bench/quant_vs_llamacpp.py`, through llama-cpp-python (the `bench` extra).

llama-cpp-python's wheel has the library but not llama.cpp's Python converter; its sdist vendors the whole
llama.cpp tree, so the converter (`convert_hf_to_gguf.py`, its `conversion` package and the matching
`gguf-py`) is taken from the sdist of the installed version. The HF directory becomes an F32 GGUF, which
`llama_model_quantize` (llama.cpp's `llama-quantize`, default options) turns into each quantized type.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import numpy as np

TYPES = ("Q8_0", "Q4_0", "Q4_K_M")


def converter(root: Path) -> Path:
    """vendor/llama.cpp of the installed llama-cpp-python's sdist (pip download), extracted once."""
    v = version("llama_cpp_python")
    tree = root / "sdist" / f"llama_cpp_python-{v}" / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    sdist = root / "sdist"
    archive = sdist / f"llama_cpp_python-{v}.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        f"llama-cpp-python=={v}", "-d", str(sdist)], check=True)
    prefix = f"llama_cpp_python-{v}/vendor/llama.cpp/"
    wanted = (prefix + "convert_hf_to_gguf.py", prefix + "conversion/", prefix + "gguf-py/")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
        tar.extractall(sdist, members=members, filter="data")
    return tree


# bench/make_models.py's random-weight checkpoints carry a made-up BPE tokenizer (no merges) that llama.cpp cannot
# load: speed runs (bench/ortgenai.py --llamacpp) write a placeholder sentencepiece-style vocabulary of the same size
# instead (<unk> <s> </s>, the 256 byte tokens, then <tN>); the ids mean nothing, the weights and shapes are the same
_ANY_TOKENIZER = """
import sys
import conversion.base as b

def placeholder_vocab(self):
    n = self.hparams["vocab_size"]
    w = self.gguf_writer
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + [f"<t{i}>" for i in range(259, n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (n - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

# the families' set_vocab (their modules load lazily) all end in one of these helpers
for helper in ("_set_vocab_sentencepiece", "_set_vocab_gpt2", "_set_vocab_llama_hf", "_set_vocab_qwen"):
    setattr(b.TextModel, helper, placeholder_vocab)
import convert_hf_to_gguf as c

sys.argv = sys.argv[1:]
c.main()
"""


def convert_f32(hf_dir: Path, out: Path, tree: Path, any_tokenizer: bool = False) -> Path:
    """convert_hf_to_gguf.py --outtype f32 (with the sdist's own gguf-py first on the path)."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), str(tree)])}
    script = ["-c", _ANY_TOKENIZER, "convert"] if any_tokenizer else [str(tree / "convert_hf_to_gguf.py")]
    done = subprocess.run([sys.executable, *script, str(hf_dir), "--outtype", "f32",
                           "--outfile", str(tmp)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    tmp.replace(out)
    return out


def f32_from_gguf(src: Path, out: Path, move: Callable[[str, np.ndarray], np.ndarray] | None = None) -> Path:
    """The GGUF with every tensor dequantized to F32 (gguf-py's reference dequantizers) and all its metadata but
    the file type: llama.cpp's F32 starting point when its converter cannot read the HF directory (Gemma's wants
    tokenizer.model, which a GGUF does not carry). Norm weights stay as the file stores them (Gemma's +1).
    move(type name, fp32 tensor) -> the tensor written (quality_source.gguf_off_grid), when given."""
    if out.is_file():
        return out
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        writer.add_tensor(t.name, move(t.tensor_type.name, w) if move else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def quantize(f32: Path, out: Path, kind: str) -> Path:
    """llama_model_quantize with llama.cpp's default parameters for the file type `kind`."""
    if out.is_file():
        return out
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = 2
    tmp = out.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {f32} -> {kind} returned {rc}")
    tmp.replace(out)
    return out


def _open(path: Path, n_ctx: int, threads: int, logits_all: bool):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                 n_threads_batch=threads, logits_all=logits_all, verbose=False)


def logits(path: Path, ids: list[int], threads: int) -> np.ndarray:
    """Teacher-forced logits [T, V] of every position: one `eval` of the ids (no BOS added by llama.cpp:
    eval takes ids as given)."""
    llm = _open(path, len(ids), threads, logits_all=True)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return out


def decode_speed(path: Path, threads: int, prompt: int = 64, new: int = 128, runs: int = 3) -> float:
    """Greedy decode tok/s after a `prompt`-token prefill of `edgellm bench`'s pseudo-random ids, one warm-up
    then the median of `runs`; timed: one eval per new token plus the argmax over its logits."""
    from edgellm.cli.bench_measure import bench_prompt

    llm = _open(path, prompt + new, threads, logits_all=False)
    ids = bench_prompt(prompt, llm.n_vocab())
    speeds = []
    for _ in range(runs + 1):
        llm.reset()
        llm.eval(ids)
        start = time.perf_counter()
        for _ in range(new):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        speeds.append(new / (time.perf_counter() - start))
    llm.close()
    return float(np.median(speeds[1:]))
