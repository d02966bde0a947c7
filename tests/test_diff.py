"""`edgellm diff`: metrics against hand computation, the gate, the report files, and end to end on real
exports (an fp32 export diffs to ~0; a copy with one corrupted layer is named as the first to drift)."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from edgellm.cli import main as cli_main
from edgellm.diff.gate import METRICS, evaluate_gate, parse_gate
from edgellm.diff.metrics import (
    first_jump,
    kl_divergence,
    largest_jump,
    logit_metrics,
    perplexity,
    tensor_errors,
    top_k_ids,
)
from edgellm.diff.report_html import SECTIONS
from edgellm.diff.report_json import SCHEMA, VERSION, dumps_report, load_report
from edgellm.export import ExportOptions, export_model
from edgellm.loaders import load_checkpoint, save_checkpoint
from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.fileio import describe_files
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.tokenizer import load_tokenizer
from edgellm.train.bpe import train_bpe_from_iterator

# ---------------------------------------------------------------------------------------------------------
# metrics


def test_kl_of_identical_distributions_is_zero():
    logits = np.random.default_rng(0).normal(size=(7, 50)) * 5
    np.testing.assert_array_equal(kl_divergence(logits, logits), np.zeros(7))
    # a constant shift of the logits is the same distribution
    np.testing.assert_allclose(kl_divergence(logits, logits + 3.0), 0.0, atol=1e-12)


def test_kl_small_case_by_hand():
    ref = np.log([[0.5, 0.5], [0.9, 0.1]])
    got = np.log([[0.25, 0.75], [0.5, 0.5]])
    expected = [0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),
                0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)]
    np.testing.assert_allclose(kl_divergence(ref, got), expected, rtol=1e-12)
    # KL is not symmetric: the reverse direction is a different number
    assert abs(kl_divergence(got, ref)[1] - expected[1]) > 1e-3


def test_logit_metrics_by_hand():
    # position 0: same argmax (0), position 1: the export prefers token 2 over the reference's token 1
    ref = np.log(np.array([[0.6, 0.3, 0.1, 1e-9, 1e-9, 1e-9],
                           [0.1, 0.7, 0.2, 1e-9, 1e-9, 1e-9]]))
    got = np.log(np.array([[0.5, 0.4, 0.1, 1e-9, 1e-9, 1e-9],
                           [0.1, 0.3, 0.6, 1e-9, 1e-9, 1e-9]]))
    m = logit_metrics(ref, got)
    assert m["top1"] == 0.5
    assert m["top5"] == 1.0  # tokens 0,1,2 plus two of the ~zero ones; the ~zero ties break by id: same sets
    dp = [0.5 / (1 + 3e-9) - 0.6 / (1 + 3e-9), 0.3 / (1 + 3e-9) - 0.7 / (1 + 3e-9)]
    assert m["dp"]["mean"] == pytest.approx(np.mean(dp), abs=1e-9)
    assert m["dp"]["worst"] == pytest.approx(-0.4, abs=1e-8)
    assert m["dp"]["rms"] == pytest.approx(math.sqrt((0.01 + 0.16) / 2), abs=1e-8)
    assert m["kl"]["max"] == pytest.approx(float(kl_divergence(ref, got)[1]))
    assert len(m["kl_per_position"]) == 2


def test_top5_overlap_counts_shared_ids():
    ref = np.arange(10, dtype=float)[None, :]          # top5: 9 8 7 6 5
    got = np.array([[9, 8, 0, 0, 0, 0, 0, 10, 11, 12]], float)  # top5: 9 8 7 0 1 (ids 7,8,9 + ties 0,1)
    assert list(top_k_ids(got, 5)[0]) == [9, 8, 7, 0, 1]
    assert logit_metrics(ref, got)["top5"] == pytest.approx(3 / 5)


def test_tensor_errors_by_hand():
    e = tensor_errors(np.array([3.0, 4.0]), np.array([3.0, 4.5]))
    assert e["rel_rms"] == pytest.approx(0.1)          # ||(0, .5)|| / ||(3, 4)||
    assert e["snr_db"] == pytest.approx(20.0)          # 10 log10(25 / 0.25)
    assert e["max_abs"] == pytest.approx(0.5)
    assert e["cosine"] == pytest.approx(27.0 / (5.0 * math.sqrt(29.25)))
    same = tensor_errors(np.ones(4), np.ones(4))
    assert same == {"cosine": 1.0, "max_abs": 0.0, "rel_rms": 0.0, "snr_db": math.inf}
    opposite = tensor_errors(np.array([1.0, 2.0]), np.array([-1.0, -2.0]))
    assert opposite["cosine"] == pytest.approx(-1.0) and opposite["snr_db"] == pytest.approx(10 * math.log10(1 / 4))
    broken = tensor_errors(np.ones(3), np.array([1.0, np.nan, 1.0]))
    assert broken["rel_rms"] == math.inf and math.isnan(broken["cosine"])


def test_perplexity_of_uniform_and_of_a_sure_model():
    tokens = [1, 4, 2, 3]
    assert perplexity(np.zeros((4, 8)), tokens) == pytest.approx(8.0)
    sure = np.full((4, 8), -50.0)
    sure[np.arange(3), tokens[1:]] = 50.0
    assert perplexity(sure, tokens) == pytest.approx(1.0)


def test_first_jump_rule():
    floor = 1e-3
    assert first_jump([1e-7, 2e-7, 3e-7], 3.0, floor) is None              # fp32 noise never counts
    assert first_jump([1e-7, 0.4, 0.5], 3.0, floor) == 1                   # a corrupted layer 1
    assert first_jump([0.01, 0.012, 0.3], 3.0, floor) == 0                 # above the floor from layer 0
    assert first_jump([0.01, 0.012, 0.3], 3.0, floor, baseline=0.008) == 2  # the embedding carried it in
    assert first_jump([0.01, 0.025, 0.02], 3.0, floor, baseline=0.01) is None  # growth below 3x the median
    assert first_jump([None, 1e-7, 0.2], 3.0, floor) == 2
    assert largest_jump([0.01, 0.012, 0.3], floor) == 2
    assert largest_jump([1e-7, 2e-7], floor) is None


# ---------------------------------------------------------------------------------------------------------
# gate


def _variant(name: str, kl: float = 0.01, top1: float = 0.99, delta_rel: float = 0.0) -> dict:
    return {"name": name, "logits": {"kl": {"mean": kl, "p99": kl * 5, "max": kl * 9}, "top1": top1, "top5": 1.0,
                                     "dp": {"mean": -0.01, "worst": -0.1, "rms": 0.02}},
            "ppl": {"ppl": 10.0, "delta_rel": delta_rel}, "greedy": {"agreement": 1.0},
            "per_layer": {"worst_rel_rms": 0.01}}


def test_gate_parses_and_evaluates():
    conds = parse_gate("kl>0.05, top1<0.9,ppl_delta>=5e-2,dp_worst<-0.3")
    assert [str(c) for c in conds] == ["kl>0.05", "top1<0.9", "ppl_delta>=0.05", "dp_worst<-0.3"]
    good, bad = _variant("int8"), _variant("int4", kl=0.2, top1=0.8)
    assert evaluate_gate(conds, [good]) == []
    failed = evaluate_gate(conds, [good, bad])
    assert [(f["variant"], f["metric"]) for f in failed] == [("int4", "kl"), ("int4", "top1")]
    assert failed[0]["value"] == 0.2
    assert evaluate_gate(parse_gate("kl>1"), [_variant("nan", kl=math.nan)])  # non-finite always fails
    for name in METRICS:  # every advertised metric reads from a variant
        evaluate_gate(parse_gate(f"{name}>1"), [_variant("x")])


@pytest.mark.parametrize("text, message", [
    ("kld>0.05", "unknown metric 'kld'"), ("kl>", "cannot parse 'kl>'"), ("kl=0.1", "cannot parse"),
    ("kl>0.05,,top1<0.9", "cannot parse ''"), ("top1 < 90%", "cannot parse"),
])
def test_gate_rejects_bad_input(text, message):
    with pytest.raises(EdgeError, match="--fail-if") as err:
        parse_gate(text)
    assert message in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# report.json


def test_report_json_is_versioned_and_round_trips_non_finite(tmp_path):
    text = dumps_report({"variants": [{"snr": math.inf, "x": -math.inf, "y": math.nan, "z": 1.5}]})
    doc = json.loads(text)  # strict JSON: no Infinity/NaN literals
    assert (doc["schema"], doc["version"]) == (SCHEMA, VERSION) == ("edgellm-diff", 1)
    assert list(doc)[:2] == ["schema", "version"]
    path = tmp_path / "report.json"
    path.write_text(text)
    back = load_report(path)["variants"][0]
    assert back["snr"] == math.inf and back["x"] == -math.inf and math.isnan(back["y"]) and back["z"] == 1.5
    path.write_text(json.dumps({**doc, "version": 2}))
    with pytest.raises(EdgeError, match="version 2 is not supported"):
        load_report(path)
    path.write_text(json.dumps({"schema": "other", "version": 1}))
    with pytest.raises(EdgeError, match="not an edgellm diff report"):
        load_report(path)


def _png_ok(b64: str) -> bool:
    return base64.b64decode(b64)[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------
# end to end: real exports of a tiny seeded model, through the CLI

CORPUS = ["Once upon a time there was a small robot who liked to count the stars.",
          "Every night the robot climbed the hill and counted: one star, two stars, many stars.",
          "One night a cloud covered the sky, and the robot learned to count the raindrops instead."] * 20


def _corrupt_qkv(export_dir: Path, layer: int, factor: float) -> None:
    """Scale layer `layer`'s fused qkv weight inside its .data file, then re-hash the manifest's files
    entry so the copy still opens (read_manifest checks sha256)."""
    graph = onnx.load(str(export_dir / f"layer_{layer}.prefill.onnx"), load_external_data=False)
    (init,) = [t for t in graph.graph.initializer if t.name.endswith("attn.qkv.weight")]
    ext = {e.key: e.value for e in init.external_data}
    data = export_dir / ext["location"]
    raw = bytearray(data.read_bytes())
    start, length = int(ext["offset"]), int(ext["length"])
    weights = np.frombuffer(bytes(raw[start:start + length]), np.float32) * np.float32(factor)
    raw[start:start + length] = weights.tobytes()
    data.write_bytes(bytes(raw))
    manifest = read_manifest(export_dir, verify=False)
    files = {**manifest.files, **describe_files(export_dir, [ext["location"]])}
    dataclasses.replace(manifest, files=files).write(export_dir)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """ckpt/ (native checkpoint with tokenizer), fp32/ (layer export), bad/ (fp32 with layer 1's qkv x4),
    int4/ (`edgellm quantize --bits 4` of fp32)."""
    root = tmp_path_factory.mktemp("diff")
    tok_path = root / "tokenizer.json"
    tok_path.write_text(train_bpe_from_iterator(CORPUS, 300).tok.to_str(), encoding="utf-8")
    (root / "story.txt").write_text(" ".join(CORPUS), encoding="utf-8")
    cfg = ModelConfig.preset_config("llama2", dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96,
                                    vocab_size=300, max_seq_len=64)
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    with torch.no_grad():  # sharper next-token distributions than the 0.02-std init, so argmaxes mean something
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    save_checkpoint(model, root / "ckpt", tokenizer=tok_path)
    export_model(model, root / "fp32", ExportOptions(max_seq=64, prefill_chunk=16), tokenizer=tok_path,
                 log=lambda _: None, progress=False)
    shutil.copytree(root / "fp32", root / "bad")
    _corrupt_qkv(root / "bad", layer=1, factor=4.0)
    assert cli_main(["quantize", str(root / "fp32"), "-o", str(root / "int4"), "--bits", "4", "--method", "rtn",
                     "--lm-head", "int4", "--no-progress"]) == 0   # the pre-issue-22 int4 default: RTN, int4 table
    return root


def _cli(*argv: str) -> int:
    return cli_main(["diff", *argv, "--quiet"])


def test_fp32_export_matches_and_corrupted_layer_is_named(work, capsys):
    out = work / "report"
    code = _cli(str(work / "ckpt"), str(work / "fp32"), str(work / "bad"), str(work / "int4"), "-o", str(out),
                "--fail-if", "top1<0.999,kl>1e-3", "--tokens", "64")
    printed = capsys.readouterr().out
    assert code == 1  # the corrupted copy fails the gate
    report = load_report(out / "report.json")
    fp32, bad, int4 = report["variants"]
    assert (fp32["name"], bad["name"], int4["name"]) == ("fp32", "bad", "int4")
    assert (fp32["precision"], int4["precision"]) == ("fp32", "int4 g32 sym rtn")

    # fp32: errors at float noise, identical argmaxes and greedy text
    layers = fp32["per_layer"]
    assert layers["available"] == ["embed", "hidden", "key", "value"]
    for entry in layers["layers"]:
        for kind in ("hidden", "key", "value"):
            assert entry[kind]["rel_rms"] < 1e-5 and entry[kind]["cosine"] > 1 - 1e-6
    assert layers["first_drift_layer"] is None
    assert fp32["logits"]["top1"] == 1.0 and fp32["logits"]["kl"]["max"] < 1e-8
    assert abs(fp32["ppl"]["delta_rel"]) < 1e-5
    assert fp32["greedy"]["agreement"] == 1.0 and fp32["greedy"]["total"] > 0

    # the corrupted copy: layer 0 untouched, layer 1 is where it starts, and it shows in the logits
    layers = bad["per_layer"]
    assert layers["layers"][0]["hidden"]["rel_rms"] < 1e-5
    assert layers["layers"][1]["key"]["rel_rms"] > 0.5  # its K rows are 4x: rel error 3
    assert layers["first_drift_layer"] == 1 and layers["largest_jump_layer"] == 1
    assert bad["logits"]["top1"] < 0.999 and bad["logits"]["kl"]["mean"] > 1e-3
    # int4 (MatMulNBits graphs): weight error visible from layer 0 on, far above fp32's
    assert int4["per_layer"]["layers"][0]["hidden"]["rel_rms"] > 1e-3
    assert int4["logits"]["kl"]["mean"] > 1e3 * max(fp32["logits"]["kl"]["mean"], 1e-12)
    gate = report["gate"]
    assert not gate["passed"] and "bad" in {f["variant"] for f in gate["failed"]}
    assert "fp32" not in {f["variant"] for f in gate["failed"]}
    assert "GATE FAILED: bad: top1" in printed and "| fp32 | 100.00 % |" in printed

    # the report files: versioned JSON with every position's KL, a self-contained HTML page
    doc = json.loads((out / "report.json").read_text())
    assert (doc["schema"], doc["version"]) == ("edgellm-diff", 1)
    assert doc["text"]["n_tokens"] == 64 and len(doc["variants"][0]["logits"]["kl_per_position"]) == 64
    html = (out / "report.html").read_text()
    for section in SECTIONS:
        assert f'<section id="{section}">' in html
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 1 + 3 and all(_png_ok(b) for b in images)  # layer curves + one KL histogram each
    assert "http" not in html.replace("http-equiv", "")  # nothing fetched from the network


def test_gate_passes_on_fp32_and_text_file_is_tokenized_by_the_export(work):
    out = work / "report-text"
    code = _cli(str(work / "ckpt"), str(work / "fp32"), "-o", str(out), "--text", str(work / "story.txt"),
                "--tokens", "40", "--prompts", "2", "--fail-if", "kl>1e-6,top1<1,ppl_delta>1e-4")
    assert code == 0
    report = load_report(out / "report.json")
    tok = load_tokenizer(work / "fp32" / "tokenizer.json.xz", 300, bos_id=1, eos_id=2)
    assert report["text"]["tokens"] == ([1] + tok.encode((work / "story.txt").read_text()))[:40]
    assert report["gate"]["passed"] and report["variants"][0]["greedy"]["agreement"] == 1.0
    prompts = report["variants"][0]["greedy"]["prompts"]
    assert [p["start"] for p in prompts] == [0, 24]
    assert prompts[1]["reference_text"] == tok.decode(prompts[1]["reference"])  # shown as text, not ids
    assert "PyTorch continuation" in (out / "report.html").read_text()


def test_bad_input_exits_2(work, capsys):
    args = [str(work / "ckpt"), str(work / "fp32"), "-o", str(work / "never")]
    assert _cli(*args, "--fail-if", "kld>0.1") == 2
    assert "--fail-if: unknown metric 'kld'" in capsys.readouterr().err
    assert _cli(*args, "--tokens", "1") == 2
    assert not (work / "never").exists()
    (work / "precious").mkdir()
    (work / "precious" / "notes.txt").write_text("keep me")
    assert _cli(str(work / "ckpt"), str(work / "fp32"), "-o", str(work / "precious")) == 2
    assert "holds no report.json" in capsys.readouterr().err
    assert (work / "precious" / "notes.txt").read_text() == "keep me"
    # a tampered copy whose manifest was not re-hashed is refused, unless --no-verify
    shutil.copytree(work / "fp32", work / "tampered")
    data = work / "tampered" / "layer_0.data"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0x40
    data.write_bytes(bytes(raw))
    assert _cli(str(work / "ckpt"), str(work / "tampered"), "-o", str(work / "never"), "--prompts", "0") == 2
    assert "sha256 differs" in capsys.readouterr().err
    assert _cli(str(work / "ckpt"), str(work / "tampered"), "-o", str(work / "never"), "--prompts", "0",
                "--no-verify") == 0


def test_model_granularity_export_reports_kv_only(work, capsys):
    """A one-graph export (other max_seq and chunk too) from a checkpoint without a tokenizer (like a
    llama2.c .bin): generated text works, per-layer errors are K/V rows only and the report says so."""
    model = load_checkpoint(work / "ckpt").model
    save_checkpoint(model, work / "ckpt-notok")
    export_model(model, work / "whole", ExportOptions(max_seq=48, prefill_chunk=8, granularity="model"),
                 log=lambda _: None, progress=False)
    out = work / "report-model"
    assert _cli(str(work / "ckpt-notok"), str(work / "fp32"), str(work / "whole"), "-o", str(out),
                "--prompts", "2", "--continuation", "8") == 0
    report = load_report(out / "report.json")
    assert report["text"]["source"] == "generated" and report["text"]["n_tokens"] == 48  # the smaller context
    whole = report["variants"][1]
    assert (whole["granularity"], whole["max_seq"], whole["prefill_chunk"]) == ("model", 48, 8)
    layers = whole["per_layer"]
    assert layers["available"] == ["key", "value"] and "Model-granularity" in layers["note"]
    assert layers["embed"] is None and all(entry["hidden"] is None for entry in layers["layers"])
    assert max(entry["error"] for entry in layers["layers"]) < 1e-5 and layers["first_drift_layer"] is None
    assert whole["logits"]["top1"] == 1.0 and whole["greedy"]["agreement"] == 1.0
    assert set(report["reference"]["ppl"]) == {"64", "48"}
    assert "Model-granularity export" in (out / "report.html").read_text()
    # --text needs a tokenizer: neither this checkpoint nor this export has one
    capsys.readouterr()
    assert _cli(str(work / "ckpt-notok"), str(work / "whole"), "-o", str(out), "--text",
                str(work / "story.txt")) == 2
    assert "use --generated" in capsys.readouterr().err
