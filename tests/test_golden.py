"""Golden greedy outputs of a tiny llama2.c checkpoint checked into tests/data (runs in any clone).

golden_tiny.bin (18.8 KB, llama2.c v0: dim 16, hidden 24, 2 layers, 2 heads / 1 kv head, vocab 32, seq_len 32,
tied; weights N(0, 0.5), norm gains 1 + N(0, 0.3), numpy default_rng(9)) is the reference (sha256 pinned); GOLDEN
was computed once from it: a change in loading, the decoder, export or the runtime that alters a greedy token
fails here. (stories260K's real-weight checks stay in test_loaders_llama2c / test_quant_quality: ../shared/.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from edgellm.cli import main
from edgellm.loaders import load_checkpoint
from tests.test_loaders_llama2c import greedy_both, read_v0

TINY = Path(__file__).parent / "data" / "golden_tiny.bin"
TINY_SHA256 = "e978b1840216a7211f682cedac3d3ad8845f9dad70d57f3c9bcc4f6a0899a56a"
PROMPT = [1, 7, 3, 12]  # BOS + 3 ids
GOLDEN = [5, 6, 15, 1, 8, 28, 19, 31, 7, 16, 7, 6, 11, 26, 0, 10, 0, 29, 0, 26, 0, 10, 8, 13, 3, 15, 1]


def test_the_checked_in_checkpoint_is_the_golden_one() -> None:
    assert hashlib.sha256(TINY.read_bytes()).hexdigest() == TINY_SHA256


def test_pytorch_and_run_c_forward_give_the_golden_tokens() -> None:
    """edgellm's loader + Decoder and an independent numpy forward (run.c's arithmetic) both continue PROMPT
    with GOLDEN."""
    ours, theirs = greedy_both(load_checkpoint(TINY).model.eval(), *read_v0(TINY), PROMPT, len(GOLDEN))
    assert ours == theirs == GOLDEN


@pytest.mark.slow
def test_export_then_run_gives_the_golden_tokens(tmp_path: Path, capsys) -> None:
    """`edgellm export` (fused layers + stack, chunk 4) then `edgellm run --temperature 0`: the same tokens."""
    assert main(["export", str(TINY), "-o", str(tmp_path / "fp32"), "--prefill-chunk", "4"]) == 0
    capsys.readouterr()
    assert main(["run", str(tmp_path / "fp32"), "--prompt-ids", ",".join(map(str, PROMPT)), "--temperature", "0",
                 "--max-new-tokens", str(len(GOLDEN)), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == GOLDEN
