"""Nothing half-written: real `edgellm` processes killed (SIGKILL) or interrupted (SIGINT) mid-way leave their
output either absent or the previous complete one - never a directory `edgellm run` accepts partially - and
the next run resumes (export: reuses the journaled units; train: continues from the last checkpoint)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgellm.cli import main
from edgellm.loaders import load_extra_state, save_checkpoint
from edgellm.runtime.manifest import read_manifest
from edgellm.train import checkpoint
from tests.export_helpers import tiny_model
from tests.runtime_fixtures import tiny_export, torch_greedy

EXPORT_FLAGS = ["--max-seq", "64", "--prefill-chunk", "8", "--no-progress"]
PROMPT = [5, 17, 33, 2, 9]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 2-layer checkpoint (head, embed, layer_0, layer_1: four export units) and its model."""
    model = tiny_model("llama2", seed=4)
    path = tmp_path_factory.mktemp("rel-kill") / "ckpt"
    save_checkpoint(model, path)
    return path, model


def spawn(tmp: Path, *argv: object) -> tuple[subprocess.Popen, Path]:
    """`python -m edgellm ARGV` with stdout+stderr in a file (a pipe nobody reads could block it)."""
    log = tmp / f"log-{time.monotonic_ns()}.txt"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "edgellm", *map(str, argv)], stdout=fh, stderr=fh)
    return proc, log


def kill_when(proc: subprocess.Popen, log: Path, ready: Callable[[], bool], sig: int,
              timeout: float = 120.0) -> None:
    """Send `sig` as soon as `ready()` holds; the process must still be running then (else the test is void)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"exit {proc.returncode} before the moment to kill it: {log.read_text()[-800:]}"
        assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
        time.sleep(0.002)
    proc.send_signal(sig)
    proc.wait(timeout=60)


def not_runnable(capsys, directory: Path) -> None:
    assert main(["run", str(directory), "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    assert "manifest.json: not found" in capsys.readouterr().err


def run_greedy(capsys, directory: Path, n: int) -> list[int]:
    argv = ["run", str(directory), "--prompt-ids", ",".join(map(str, PROMPT)), "--temperature", "0",
            "--max-new-tokens", str(n), "--json"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["token_ids"]


def test_export_sigkilled_after_the_first_layer_graph_then_resumed(tmp_path, capsys, ckpt):
    path, model = ckpt
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    proc, log = spawn(tmp_path, "export", path, "-o", out, *EXPORT_FLAGS)
    kill_when(proc, log, lambda: (partial / "layer_0.prefill.onnx").exists(), signal.SIGKILL)
    assert not out.exists()
    not_runnable(capsys, out)
    not_runnable(capsys, partial)  # the work directory is never mistaken for an export
    journaled = set(json.loads((partial / "journal.json").read_text())["units"])
    assert {"head", "embed"} <= journaled and "layer_1" not in journaled

    assert main(["export", str(path), "-o", str(out), *EXPORT_FLAGS]) == 0
    log = capsys.readouterr().err
    assert "resuming an interrupted export" in log
    for unit in journaled:
        assert f"reusing {unit} (checksums match)" in log
    assert "reusing layer_1" not in log
    read_manifest(out, verify=True)
    assert not partial.exists()
    model.set_context_len(64)
    assert run_greedy(capsys, out, 6) == torch_greedy(model, PROMPT, 6)  # the resumed export is right


def test_export_interrupted_by_sigint_keeps_the_previous_export(tmp_path, tmp_path_factory, capsys, ckpt):
    path, _ = ckpt
    out = tmp_path / "out"
    shutil.copytree(tiny_export(tmp_path_factory, "llama2", "layer")[0], out)  # a previous complete export
    before = (out / "manifest.json").read_bytes()
    proc, log = spawn(tmp_path, "export", path, "-o", out, *EXPORT_FLAGS)
    # as soon as the work directory exists: the whole export still ahead (waiting for layer_0's graph left ~2 s,
    # and a loaded 2-core host once let the export finish first: rc 0 with the signal lost at its exit)
    kill_when(proc, log, lambda: (tmp_path / "out.partial").is_dir(), signal.SIGINT)
    err = log.read_text()
    assert proc.returncode == 130 and err.rstrip().endswith("edgellm export: interrupted"), err
    assert "Traceback" not in err
    assert (out / "manifest.json").read_bytes() == before
    read_manifest(out, verify=True)
    assert len(run_greedy(capsys, out, 3)) == 3


def test_quantize_sigkilled_leaves_no_output_and_reruns_cleanly(tmp_path, tmp_path_factory, capsys):
    src = tiny_export(tmp_path_factory, "llama2", "layer")[0]
    out = tmp_path / "q"
    proc, log = spawn(tmp_path, "quantize", src, "-o", out, "--bits", "4", "--no-progress")
    work = tmp_path / f".q.tmp-{proc.pid}"  # runtime.fileio.atomic_dir's work directory
    kill_when(proc, log, lambda: work.is_dir() and any(work.iterdir()), signal.SIGKILL)
    assert not out.exists() and work.is_dir()  # killed while writing: only the hidden work dir exists
    not_runnable(capsys, out)

    assert main(["quantize", str(src), "-o", str(out), "--bits", "4", "--no-progress"]) == 0
    capsys.readouterr()
    assert read_manifest(out, verify=True).quantization is not None
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".q.")) == []  # stale dir removed
    assert len(run_greedy(capsys, out, 3)) == 3


def test_diff_sigkilled_leaves_no_report(tmp_path, tmp_path_factory, capsys):
    src, model = tiny_export(tmp_path_factory, "llama2", "layer")
    ckpt = tmp_path / "ckpt"
    save_checkpoint(model, ckpt)
    out = tmp_path / "report"
    # 8 prompts x 24 greedy tokens: ~1 s between the first progress output and the report's rename
    argv = ["diff", ckpt, src, "-o", out, "--tokens", "64", "--prompts", "8", "--continuation", "24"]
    proc, log = spawn(tmp_path, *argv)
    # the moment: the progress bar has started, so the report is being computed
    kill_when(proc, log, lambda: "diff:" in log.read_text(errors="replace"), signal.SIGKILL)
    assert not out.exists()
    assert main([*map(str, argv), "--quiet"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.")]


def test_train_sigkilled_mid_run_resumes_from_the_last_complete_checkpoint(tmp_path, capsys):
    data = tmp_path / "tokens.npy"
    np.save(data, (np.arange(20_000) * 7 % 64).astype(np.int32))
    config = tmp_path / "model.json"
    config.write_text(json.dumps({"preset": "llama2", "vocab_size": 64, "dim": 32, "n_layers": 1, "n_heads": 4,
                                  "n_kv_heads": 2, "hidden_dim": 64, "max_seq_len": 32}))
    out = tmp_path / "run"
    steps = 600
    flags = ["--steps", steps, "--save-every", 25, "--batch-size", 4, "--seq-len", 16, "--eval-every", 10_000,
             "--eval-steps", 1, "--threads", 1, "--quiet"]
    proc, log = spawn(tmp_path, "train", "--config", config, "--data", data, "-o", out, *flags)
    kill_when(proc, log, lambda: checkpoint.is_complete(out), signal.SIGKILL)

    checkpoint.recover(out)  # what --resume does first: finish or undo a swap the kill interrupted
    saved = load_extra_state(out)
    assert 0 < saved["step"] < steps
    assert main(["train", "--data", str(data), "-o", str(out), "--resume", *map(str, flags)]) == 0
    capsys.readouterr()
    final = load_extra_state(out)
    assert final["step"] == steps and final["losses"][: saved["step"]] == saved["losses"]  # continued
    assert not (tmp_path / "run.tmp").exists() and not (tmp_path / "run.old").exists()
