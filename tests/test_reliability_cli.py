"""Bad input through the real CLI, every verb: exit code 2, ONE stderr line naming the file or flag, no
traceback, nothing written. In-process (`edgellm.cli.main`) for the matrix, and real `python -m edgellm`
subprocesses for the exit code / one-line / no-traceback contract as a user sees it. Corrupt exports:
test_reliability_exports.py."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.cli_helpers import copy_with, edit_json, fails, tiny_checkpoint, truncate
from tests.runtime_fixtures import bigram_export, tiny_export


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """The shared tiny llama2 export: 2 layers, max_seq 64, prefill chunk 8, no tokenizer."""
    return tiny_export(tmp_path_factory, "llama2", "layer")[0]


@pytest.fixture(scope="module")
def bigram(tmp_path_factory) -> Path:
    """The shared export that carries a tokenizer.json."""
    return bigram_export(tmp_path_factory)


# ------------------------------------------------------------------------------------------ missing paths


def test_missing_paths_every_verb(tmp_path, capsys, ckpt, export):
    gone, out = tmp_path / "gone", tmp_path / "out"
    cases = [
        ["info", gone],
        ["export", gone, "-o", out],
        ["train", "--preset", "llama2", "--vocab-size", "300", "--data", gone, "-o", out],
        ["tokenizer", "encode", tmp_path / "gone.json", "--text", "a"],
        ["quantize", gone, "-o", out, "--bits", "8"],
        ["run", gone, "--prompt-ids", "1"],
        ["bench", gone],
        ["diff", gone, export, "-o", out],
        ["diff", ckpt, gone, "-o", out],
    ]
    for argv in cases:
        fails(capsys, argv, gone.name)
        assert not out.exists(), argv


def no_read_override() -> list[str]:
    """A command prefix under which chmod 000 really denies reading: nothing for a normal user; as root,
    `setpriv` without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH (root reads anything otherwise)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a chmod 000 file stays readable, so the case cannot exist")
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}"]


def test_unreadable_files(tmp_path, ckpt, export):
    """chmod 000 weights in a checkpoint and in an export: exit 2, one line naming the file, no traceback."""
    prefix = no_read_override()
    ck = shutil.copytree(ckpt, tmp_path / "ckpt")
    ex = shutil.copytree(export, tmp_path / "export")
    for path in (ck / "model.safetensors", ex / "layer_0.data"):
        path.chmod(0)
    probe = subprocess.run([*prefix, sys.executable, "-c", f"open({str(ex / 'layer_0.data')!r}, 'rb')"],
                           capture_output=True)
    if probe.returncode == 0:
        pytest.skip("chmod 000 does not stop this process from reading (root with CAP_DAC_OVERRIDE)")
    cases = [(["info", ck], "model.safetensors: cannot read (Permission denied)"),
             (["export", ck, "-o", tmp_path / "out"], "model.safetensors: cannot read (Permission denied)"),
             (["run", ex, "--prompt-ids", "1"], "layer_0.data: cannot read (Permission denied)"),
             (["run", ex, "--prompt-ids", "1", "--no-verify"], "layer_0.data: cannot read the weights")]
    procs = [subprocess.Popen([*prefix, sys.executable, "-m", "edgellm", *map(str, argv)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv, _ in cases]
    for (_, needle), proc in zip(cases, procs, strict=True):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_wrong_kind_of_directory(tmp_path, capsys, ckpt, export):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    for argv, needle in [
        (["info", empty], "not a checkpoint edgellm can load"),
        (["export", export, "-o", out], "not a checkpoint edgellm can load"),
        (["run", ckpt, "--prompt-ids", "1"], "manifest.json: not found"),  # a checkpoint is not an export
        (["bench", empty], "manifest.json: not found"),
        (["quantize", ckpt, "-o", out, "--bits", "4"], "manifest.json: not found"),
        (["diff", ckpt, empty, "-o", out], "manifest.json: not found"),
        (["diff", export, export, "-o", out], "not a checkpoint edgellm can load"),
        (["tokenizer", "encode", export / "manifest.json", "--text", "a"], "not a tokenizer.json"),
    ]:
        fails(capsys, argv, needle)
        assert not out.exists(), argv


def test_outputs_that_would_overwrite_something_else(tmp_path, capsys, ckpt, export):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    fails(capsys, ["export", ckpt, "-o", mine, "--max-seq", "16", "--prefill-chunk", "4"], mine, "manifest.json")
    fails(capsys, ["export", ckpt, "-o", afile], afile, "not a directory")
    fails(capsys, ["quantize", export, "-o", mine, "--bits", "8"], mine, "manifest.json")
    fails(capsys, ["quantize", export, "-o", export / "q", "--bits", "8"], "inside the input export")
    fails(capsys, ["diff", ckpt, export, "-o", mine], mine, "report.json")
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"] and afile.read_text() == "x"


def test_output_paths_through_a_file(tmp_path, capsys, ckpt, export):
    """-o under a regular file: one line naming the path, before any work (train: found by this suite, it
    used to end in a NotADirectoryError traceback, as did export)."""
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    data, config = tmp_path / "tokens.npy", tmp_path / "cfg.json"
    np.save(data, np.arange(500, dtype=np.int32) % 64)
    config.write_text(json.dumps({"preset": "llama2", "vocab_size": 64, "dim": 32, "n_layers": 1, "n_heads": 4,
                                  "hidden_dim": 32, "max_seq_len": 32}))
    sub = afile / "sub"
    fails(capsys, ["export", ckpt, "-o", sub], "a.txt is not a directory")
    fails(capsys, ["train", "--config", config, "--data", data, "-o", sub, "--steps", "2", "--quiet"], "a.txt/sub")
    fails(capsys, ["quantize", export, "-o", sub, "--bits", "8", "--no-progress"], "a.txt/sub")
    fails(capsys, ["tokenizer", "train", config, "--vocab-size", "300", "-o", sub / "t.json"], "a.txt/sub")
    assert afile.read_text() == "x"


# ------------------------------------------------------------------------------- presets and config keys


def test_unknown_preset_and_config_keys(tmp_path, capsys, ckpt):
    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(500, dtype=np.int32) % 64)
    config = tmp_path / "cfg.json"
    out = tmp_path / "out"
    fails(capsys, ["train", "--preset", "gpt9", "--data", data, "-o", out], "--preset gpt9")
    config.write_text(json.dumps({"preset": "llama2", "vocab_size": 64, "flash_attention": True}))
    fails(capsys, ["train", "--config", config, "--data", data, "-o", out], config, "flash_attention")
    config.write_text(json.dumps({"preset": "gpt9", "vocab_size": 64}))
    fails(capsys, ["train", "--config", config, "--data", data, "-o", out], config, "gpt9")
    config.write_text(json.dumps({"preset": "llama2", "vocab_size": 64, "train": {"wings": 2}}))
    fails(capsys, ["train", "--config", config, "--data", data, "-o", out], config, "wings")
    config.write_text("{not json")
    fails(capsys, ["train", "--config", config, "--data", data, "-o", out], config, "JSON")
    bad = copy_with(ckpt, tmp_path / "ckpt", lambda d: edit_json(d / "edgellm.json",
                                                                   lambda doc: doc["config"].update(wings=2)))
    fails(capsys, ["info", bad], "edgellm.json", "unknown config keys: wings")
    fails(capsys, ["export", bad, "-o", out], "edgellm.json", "wings")
    assert not out.exists()


# ---------------------------------------------------------------------------------- corrupt checkpoints


def _header_len(value: int) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(value.to_bytes(8, "little") + data[8:])
    return edit


@pytest.mark.parametrize(("edit", "needle"), [
    (truncate("model.safetensors", 0.5), "model.safetensors"),
    (truncate("model.safetensors", 0.0), "model.safetensors"),
    (_header_len(1 << 60), "model.safetensors"),
    (_header_len(100), "model.safetensors"),
    (truncate("edgellm.json", 0.5), "edgellm.json"),
    (lambda d: edit_json(d / "edgellm.json", lambda doc: doc.update(format_version=99)), "format_version 99"),
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors: missing"),
], ids=["half-weights", "empty-weights", "header-2^60", "header-short", "half-marker", "version", "no-weights"])
def test_corrupt_checkpoint(tmp_path, capsys, ckpt, edit, needle):
    bad = copy_with(ckpt, tmp_path / "ckpt", edit)
    fails(capsys, ["info", bad], needle)
    fails(capsys, ["export", bad, "-o", tmp_path / "out"], needle)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_corrupt_llama2c_bin_and_tokenizer_files(tmp_path, capsys):
    bin_ = tmp_path / "model.bin"
    bin_.write_bytes(struct.pack("<7i", 64, 128, 2, 4, 4, 64, 32) + b"\0" * 100)  # a header, few weights
    fails(capsys, ["info", bin_], "model.bin", "implies")
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {')
    fails(capsys, ["tokenizer", "encode", tok, "--text", "a"], "tokenizer.json")
    fails(capsys, ["tokenizer", "decode", tok, "1"], "tokenizer.json")
    tbin = tmp_path / "tokenizer.bin"
    tbin.write_bytes(b"\x10\0\0\0" + b"\0" * 5)
    fails(capsys, ["tokenizer", "encode", tbin, "--text", "a", "--vocab-size", "32"], "tokenizer.bin")
    fails(capsys, ["tokenizer", "encode", tbin, "--text", "a"], "--vocab-size")
    data = tmp_path / "corpus.txt"
    data.write_text("hello world\n\nmore text\n")
    fails(capsys, ["train", "--preset", "llama2", "--tokenizer", tok, "--data", data, "-o", tmp_path / "o"],
          "tokenizer.json")


def test_export_rejects_a_checkpoint_with_a_corrupt_tokenizer(tmp_path, capsys, ckpt):
    """Found by this suite: export used to copy a broken tokenizer.json into a 'complete' export that then
    could never run a text prompt. It is now loaded (as `edgellm run` will) before any graph is built."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}, "x": [')
    bad = copy_with(ckpt, tmp_path / "ckpt", lambda d: (shutil.copyfile(tok, d / "tokenizer.json"), edit_json(
        d / "edgellm.json", lambda doc: doc.update(tokenizer="tokenizer.json"))))
    fails(capsys, ["export", bad, "-o", tmp_path / "out", "--max-seq", "16", "--prefill-chunk", "4"],
          "tokenizer.json")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


# ----------------------------------------------------------------------------- sampling, prompt, context


@pytest.mark.parametrize(("flags", "needle"), [
    (["--temperature", "-0.5"], "--temperature"), (["--top-p", "0"], "--top-p"), (["--top-p", "1.01"], "--top-p"),
    (["--top-k", "-1"], "--top-k"), (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--repetition-penalty", "0"], "--repetition-penalty"), (["--prompt", ""], "--prompt"),
    (["--prompt-ids", ""], "--prompt-ids"), (["--prompt-ids", "1,-3"], "--prompt-ids"),
])
def test_bad_sampling_and_prompt_flags(capsys, bigram, flags, needle):
    prompt = [] if any(f.startswith("--prompt") for f in flags) else ["--prompt", "a"]
    fails(capsys, ["run", bigram, *prompt, *flags], needle)


def test_bench_flags(capsys, export):
    fails(capsys, ["bench", export, "--threads", "0"], "--threads")
    fails(capsys, ["bench", export, "--runs", "0"], "--runs")
    fails(capsys, ["bench", export, "--new-tokens", "64"], "--contexts")  # no room left in max_seq 64
    fails(capsys, ["bench", export, "--contexts", "8,x"], "--contexts")


# ------------------------------------------------------------------------------ as a user sees it: processes


def test_every_verb_as_a_process_exits_2_with_one_line(tmp_path, ckpt, export):
    """Real `python -m edgellm` processes, run side by side: exit 2, one stderr line, no traceback."""
    bad = copy_with(export, tmp_path / "bad",
                    lambda d: edit_json(d / "manifest.json", lambda m: m.update(format_version=99)))
    gone, out = tmp_path / "gone", tmp_path / "out"
    cases = {
        "info": (["info", gone], gone.name),
        "train": (["train", "--preset", "gpt9", "--vocab-size", "300", "--data", ckpt / "edgellm.json", "-o", out],
                  "--preset gpt9"),
        "tokenizer": (["tokenizer", "encode", ckpt / "edgellm.json", "--text", "a"], "edgellm.json"),
        "export": (["export", bad, "-o", out], "not a checkpoint"),
        "quantize": (["quantize", bad, "-o", out, "--bits", "4"], "format_version 99"),
        "run": (["run", export, "--prompt-ids", "1", "--top-k", "-1"], "--top-k"),
        "bench": (["bench", bad], "format_version 99"),
        "diff": (["diff", ckpt, bad, "-o", out], "format_version 99"),
        "argparse": (["run", export, "--max-new-tokens", "many"], "--max-new-tokens"),
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "edgellm", *map(str, argv)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, (argv, _) in cases.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        argv, needle = cases[name]
        assert proc.returncode == 2, (name, stderr)
        assert stderr.count("\n") == 1 and stderr.startswith(f"edgellm {argv[0]}: error: "), (name, stderr)
        assert needle in stderr and "Traceback" not in stderr and stdout == "", (name, stderr)
    assert not out.exists()

