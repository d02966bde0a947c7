"""Data-parallel training: `torchrun --nproc_per_node 2` with batch B equals one process with batch 2B."""

from __future__ import annotations

import subprocess
import sys

from edgellm.cli import main
from edgellm.loaders import load_checkpoint, load_extra_state
from edgellm.model import Decoder
from edgellm.train.bpe import train_bpe
from edgellm.train.corpus import write_corpus

ARGS = ["--preset", "llama2", "--dim", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
        "--hidden-dim", "64", "--seq-len", "32", "--steps", "8", "--warmup", "2", "--lr", "3e-3", "--grad-accum",
        "2", "--eval-every", "4", "--eval-steps", "2", "--quiet", "--threads", "1"]


def test_two_processes_match_one_process_with_the_doubled_batch(tmp_path):
    write_corpus(str(tmp_path / "c.txt"), 400, seed=2)
    train_bpe([tmp_path / "c.txt"], 300, tmp_path / "tokenizer.json")
    common = [*ARGS, "--data", str(tmp_path / "c.txt"), "--tokenizer", str(tmp_path / "tokenizer.json")]
    two = tmp_path / "two"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "edgellm", "train", *common, "--batch-size", "4", "-o", str(two)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("trained 8 steps") == 1  # only rank 0 prints
    one = tmp_path / "one"
    assert main(["train", *common, "--batch-size", "8", "-o", str(one)]) == 0

    a, b = load_extra_state(one), load_extra_state(two)
    assert a["world"] == 1 and b["world"] == 2 and len(b["torch_rng"]) == 2
    assert len(a["losses"]) == len(b["losses"]) == 8
    for x, y in zip(a["losses"], b["losses"], strict=True):
        assert abs(x - y) < 1e-5, (a["losses"], b["losses"])
    for (sa, va), (sb, vb) in zip(a["evals"], b["evals"], strict=True):
        assert sa == sb and abs(va - vb) < 1e-5
    wa, wb = load_checkpoint(one).model.state_dict(), load_checkpoint(two).model.state_dict()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    # and the runs really trained: the loss fell and the weights moved from the shared initialisation
    assert a["losses"][-1] < a["losses"][0] - 0.2
    init = Decoder(load_checkpoint(one).config)
    init.reset_parameters(a["train_config"]["seed"])
    assert (init.state_dict()["layers.0.mlp.down.weight"] - wa["layers.0.mlp.down.weight"]).abs().max() > 1e-3
