"""GGUF through the CLI: `info` describes the file; `export model.gguf` -> `run` generates what transformers
generates from the same file, and `run --chat` uses the template the GGUF carried; every kind of bad GGUF is
one error line (exit 2, no traceback, nothing written) from every verb that loads a checkpoint."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgellm.cli import main
from tests.gguf_helpers import Q, bpe_vocab, hf_model, reference, write_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A qwen2 GGUF (Q8_0 weights, byte-level BPE vocabulary, ChatML template)."""
    v = bpe_vocab()
    return write_gguf(tmp_path_factory.mktemp("gguf-cli") / "tiny.gguf", hf_model("qwen2", len(v["tokens"]), seed=5),
                      "qwen2", v, qtype=Q.Q8_0)


def test_info_prints_the_gguf_header(good, capsys):
    assert main(["info", str(good)]) == 0
    out = capsys.readouterr().out
    for line in ("source: gguf", "preset: qwen2", "gguf version: 3", "gguf architecture: qwen2",
                 "gguf tensors: 27 (Q8_0 x16, F32 x11)", "tokenizer: "):
        assert line in out, (line, out)


def test_export_then_run_matches_transformers(good, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["export", str(good), "-o", str(out), "--max-seq", "64", "--prefill-chunk", "8",
                 "--no-progress"]) == 0
    capsys.readouterr()
    model, tok = reference(good)
    prompt = tok("Hello world", add_special_tokens=False).input_ids
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert main(["run", str(out), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "8",
                 "--temperature", "0", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    assert got == want[:len(got)] and (len(got) == 8 or want[len(got)] == 2), (got, want)  # 2: eos
    assert (out / "chat_template.jinja").is_file()  # the template came from the GGUF metadata
    assert main(["run", str(out), "--chat", "--prompt", "Hi", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert main(["diff", str(good), str(out), "-o", str(tmp_path / "report"), "--tokens", "24", "--prompts", "1",
                 "--prompt-len", "4", "--continuation", "4", "--quiet"]) == 0  # the fp32 export vs the GGUF
    assert json.loads((tmp_path / "report" / "report.json").read_text())["checkpoint"]["source"] == "gguf"


def _rewrite(path: Path, dst: Path, edit) -> Path:
    data = bytearray(path.read_bytes())
    edit(data)
    dst.write_bytes(bytes(data))
    return dst


def _bad(tmp_path: Path, good: Path, kind: str) -> tuple[Path, str]:
    """(a broken GGUF, what its error must say)."""
    v = bpe_vocab()
    model = hf_model("qwen2", len(v["tokens"]), seed=5)
    f = tmp_path / f"{kind}.gguf"
    if kind == "truncated-data":
        return _rewrite(good, f, lambda d: d.__delitem__(slice(len(d) - 5000, None))), "truncated GGUF file"
    if kind == "truncated-header":
        return _rewrite(good, f, lambda d: d.__delitem__(slice(200, None))), "corrupt or truncated GGUF file"
    if kind == "bad-magic":
        return _rewrite(good, f, lambda d: d.__setitem__(slice(0, 4), b"GGUX")), "not a GGUF file"
    if kind == "big-endian":  # version 3 written big-endian: refused, not misread
        return _rewrite(good, f, lambda d: d.__setitem__(slice(4, 8), struct.pack(">I", 3))), "a big-endian GGUF file"
    if kind == "version":
        return _rewrite(good, f, lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 9))), "GGUF version 9"
    if kind == "arch":
        return write_gguf(f, model, "qwen2", v, arch="rwkv6"), "GGUF architecture 'rwkv6' is not supported"
    if kind == "tensor-type":
        return (write_gguf(f, model, "qwen2", v, tensor_types={"blk.1.ffn_down.weight": Q.Q2_K}),
                "tensor blk.1.ffn_down.weight has ggml type Q2_K")
    if kind == "missing-key":
        return write_gguf(f, model, "qwen2", v, drop=("qwen2.block_count",)), "missing metadata key qwen2.block_count"
    if kind == "shape":
        return (write_gguf(f, model, "qwen2", v, meta={"{arch}.feed_forward_length": 128}),
                "give 320 rows for layers.0.mlp.gate_up.weight; expected 256")
    raise AssertionError(kind)


KINDS = ["truncated-data", "truncated-header", "bad-magic", "big-endian", "version", "arch", "tensor-type", "missing-key", "shape"]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_gguf_is_one_line_from_every_verb(good, tmp_path, capsys, kind):
    path, message = _bad(tmp_path, good, kind)
    for argv in (["info", path], ["export", path, "-o", tmp_path / "out", "--no-progress"],
                 ["diff", path, tmp_path / "no-export", "-o", tmp_path / "report"]):
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (argv, code, err)
        assert message in err and str(path) in err, (argv, err)
    assert not any((tmp_path / name).exists() for name in ("out", "out.partial", "report"))


def test_bad_gguf_through_a_real_process(good, tmp_path):
    path, message = _bad(tmp_path, good, "version")
    proc = subprocess.run([sys.executable, "-m", "edgellm", "info", str(path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr
