"""`edgellm quantize --calibration-text FILE`: calibration on the start of a user's text, tokenized by the
export's own tokenizer, instead of text the export samples itself (quant/calibrate.py)."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from edgellm.cli import main
from edgellm.quant.calibrate import text_sequences
from edgellm.runtime.manifest import read_manifest
from tests.quant_helpers import quantize
from tests.runtime_fixtures import bigram_export

TEXT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return bigram_export(tmp_path_factory)


def test_text_is_cut_into_sequences_of_the_tokenizers_ids(src, tmp_path) -> None:
    text = tmp_path / "users.txt"
    text.write_text(TEXT, encoding="utf-8")
    m = read_manifest(src)
    raw = (src / m.tokenizer["file"]).read_bytes()
    raw = lzma.decompress(raw) if m.tokenizer["file"].endswith(".xz") else raw     # format 11 ships it xz-packed
    ids = Tokenizer.from_str(raw.decode()).encode(TEXT, add_special_tokens=False).ids
    got = text_sequences(src, text, 200, length=64)
    bos = [m.bos_id] if m.add_bos and m.bos_id is not None else []
    assert all(len(s) <= 64 and s[:len(bos)] == bos for s in got)
    flat = [t for s in got for t in s[len(bos):]]
    assert len(flat) >= 200 - 64 and flat == ids[:len(flat)]


def test_quantize_records_the_text_it_calibrated_on(src, tmp_path) -> None:
    text = tmp_path / "users.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = quantize(src, tmp_path / "q", bits=4, method="awq", calibration_tokens=96, calibration_text=str(text))
    calibration = read_manifest(out).quantization["calibration"]
    assert "users.txt" in calibration["source"] and 2 <= calibration["tokens"] <= 96 + 64
    sampled = quantize(src, tmp_path / "s", bits=4, method="awq", calibration_tokens=96)
    assert "sampled" in read_manifest(sampled).quantization["calibration"]["source"]


@pytest.mark.parametrize(("make", "flags", "want"), [
    (None, ["--bits", "4"], "--calibration-text: {missing}: not a file"),
    ("text", ["--bits", "8", "--method", "rtn"], "--calibration-text: nothing here calibrates"),
    ("empty", ["--bits", "4"], "--calibration-text: {path} is empty"),
])
def test_bad_calibration_text_is_one_line(src, tmp_path, capsys, make, flags, want) -> None:
    path = tmp_path / "given.txt"
    if make == "text":
        path.write_text(TEXT, encoding="utf-8")
    elif make == "empty":
        path.write_text("  \n", encoding="utf-8")
    out = tmp_path / "q"
    missing = tmp_path / "missing.txt"
    arg = str(missing if make is None else path)
    code = main(["quantize", str(src), "-o", str(out), *flags, "--calibration-text", arg, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and want.format(missing=missing, path=path) in err, err
    assert not out.exists()


def test_kl_budget_rungs_keep_the_text_only_where_they_calibrate(tmp_path) -> None:
    from edgellm.quant.budget import variants
    from edgellm.quant.options import QuantizeOptions

    text = tmp_path / "users.txt"
    text.write_text(TEXT, encoding="utf-8")
    ladder = variants(QuantizeOptions(method="rtn", calibration_text=str(text)))
    for _, v in ladder:
        v.validate()                                   # rtn rungs without a split would refuse the text
        assert (v.calibration_text is not None) == v.calibrated
    assert any(v.calibration_text for _, v in ladder) and not all(v.calibration_text for _, v in ladder)
