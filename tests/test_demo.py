"""`edgellm demo` end to end (the tiny size): trains, exports, quantizes to int8 and int4, runs each export and
diffs them all against the PyTorch model — the README's main command, on a model small enough for CI."""

from __future__ import annotations

import json
import re

import pytest

from edgellm.cli import main
from edgellm.quant.options import INT8_GROUP
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.stats import peak_rss_mb

pytestmark = pytest.mark.slow


def test_demo_quantizes_to_int8_and_int4_and_runs_every_export(tmp_path, capfd):
    out = tmp_path / "demo"
    assert main(["demo", "-o", str(out), "--size", "tiny", "--seed", "0"]) == 0
    printed = capfd.readouterr()
    text = printed.out + printed.err

    # the exports: fp32 with its stack graph, int8 and int4 block-wise (the defaults), each a readable manifest
    fp32, int8, int4 = (read_manifest(out / n) for n in ("fp32", "int8", "int4"))
    assert fp32.quantization is None and fp32.has_stack
    # the int4 default (--profile balanced): AWQ + the k-quant search of block offsets, the most sensitive linears int8
    assert (int4.quantization["options"]["method"], int4.quantization["options"]["block_min"]) == ("awq", "on")
    for manifest, bits, group in ((int8, 8, INT8_GROUP), (int4, 4, 32)):
        assert manifest.quantization["options"]["bits"] == bits
        weights = manifest.quantization["weights"]
        linears = [w for n, w in weights.items() if w["op"] != "Gather" and not n.startswith("lm_head.")]
        promoted = [w for w in linears if w["bits"] == 8 and bits == 4]
        assert linears and {w["bits"] for w in linears} - {8} <= {bits} and len(promoted) < len(linears) / 2
        assert {w["block_size"] for w in linears} == {group}
        # offsets where K is whole blocks (not the tiny model's down, K = 176: symmetric blocks there)
        assert any(w["offsets"] for w in linears) == (bits == 4)
    # the lm_head int8, every row of it
    assert int8.quantization["weights"]["lm_head.weight"]["bits"] == int4.quantization["weights"]["lm_head.weight"]["bits"] == 8

    # each export generated text: the side-by-side greedy lines are non-empty
    for name in ("fp32", "int8", "int4"):
        line = re.search(rf"\[{name}\] (.+)\n\s+\((\d+) tok/s decode\)", text)
        assert line is not None and len(line.group(1).strip()) > 5 and int(line.group(2)) > 0, name

    # the sampled run stage ran in its own process: its peak RSS is the runtime's, far below this process's
    # (torch, training), and it streamed text before its stats line
    stats = re.search(r"\[(max_new_tokens|eos|stop|length)\] prompt \d+ tok .* peak RSS (\d+) MB", text)
    assert stats is not None
    ours_mb = peak_rss_mb()
    assert int(stats.group(2)) < ours_mb, (stats.group(2), ours_mb)

    # the diff report covers the three exports, and fp32 matches the PyTorch model
    report = json.loads((out / "report" / "report.json").read_text())
    assert [v["name"] for v in report["variants"]] == ["fp32", "int8", "int4"]
    fp32_row = report["variants"][0]
    assert fp32_row["logits"]["top1"] == pytest.approx(1.0)
    assert fp32_row["greedy"]["agreed"] == fp32_row["greedy"]["total"] > 0
    assert (out / "report" / "report.html").is_file()
