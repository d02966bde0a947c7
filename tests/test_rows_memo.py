"""runtime/rows_memo.py and the CLI's use of it (edgellm/cli/speculation.py): whether this machine computes an
export's verification rows as its decode steps is measured once per (export, onnxruntime, CPU, threads) and
remembered; a greedy run then opens the stack that can use it — the spare-row stack where the rows are exact,
the lone-row stack where they cannot be (it decodes faster and the spare row would buy nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgellm.cli import main
from edgellm.cli.speculation import open_generator
from edgellm.runtime.generator import Generator
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.rows_memo import FORMAT, KEEP, Verdict, memo_key, memo_path, recall, remember
from edgellm.runtime.session import SessionConfig
from edgellm.runtime.speculative import rows_exact_here
from tests.export_helpers import default_export
from tests.quant_helpers import quantize

PROMPT = ",".join(str(t) for t in np.random.default_rng(4).integers(3, 256, 9))


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> Path:
    return default_export(tmp_path_factory.mktemp("memo") / "fp32")


@pytest.fixture(scope="module")
def int4(fp32: Path) -> Path:
    return quantize(fp32, fp32.parent / "int4", bits=4)


@pytest.fixture(autouse=True)
def empty_memo():
    memo_path().unlink(missing_ok=True)
    yield
    memo_path().unlink(missing_ok=True)


def test_a_verdict_is_kept_per_key_and_a_bad_file_is_measured_past(tmp_path: Path, capsys, fp32: Path) -> None:
    path = tmp_path / "rows.json"
    assert recall("a", path) is None  # no file yet
    remember("a", Verdict(False, 0.25), fp32, path)
    remember("b", Verdict(True, 0.0), fp32, path)
    assert recall("a", path) == Verdict(False, 0.25, remembered=True)
    assert recall("b", path) == Verdict(True, 0.0, remembered=True) and recall("c", path) is None
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["version"] == 1 and doc["verdicts"]["a"]["export"] == str(fp32.resolve())
    for text in ("{not json", json.dumps({**doc, "version": 2}), json.dumps({"format": "other", "version": 1})):
        path.write_text(text)
        assert recall("a", path) is None
        assert f"{path}: ignored" in capsys.readouterr().err
        remember("a", Verdict(True, 0.0), fp32, path)  # rewritten whole, in the current format
        assert recall("a", path) == Verdict(True, 0.0, remembered=True)
    remember("b", Verdict(True, 0.0), fp32, path)
    doc = json.loads(path.read_text())
    doc["verdicts"]["a"]["diff"] = "x"  # an entry edited by hand: that one is not read
    path.write_text(json.dumps(doc))
    assert recall("a", path) is None and recall("b", path) == Verdict(True, 0.0, remembered=True)
    for i in range(KEEP + 3):
        remember(f"k{i}", Verdict(True, 0.0), fp32, path)
    assert len(json.loads(path.read_text())["verdicts"]) == KEEP
    (tmp_path / "file").write_text("")
    remember("a", Verdict(True, 0.0), fp32, tmp_path / "file" / "rows.json")  # cannot be written: no error


def test_the_key_names_the_export_and_the_threads(fp32: Path, int4: Path) -> None:
    assert memo_key(fp32, 2) == memo_key(fp32, 2)
    assert len({memo_key(fp32, 2), memo_key(fp32, 1), memo_key(int4, 2)}) == 3


def _bench_stack(export: Path, *flags: str) -> None:
    assert main(["bench", str(export), "--threads", "2", "--runs", "1", "--new-tokens", "2", "--contexts", "4",
                 "--json", "--max-other-load", "100", *flags]) == 0


def test_the_first_greedy_run_measures_and_every_run_decodes_through_one_stack(int4: Path, capsys) -> None:
    """Whatever this CPU's 4-bit kernels do (AVX2-only x86: a lone row differs; AVX-512: alike), the verdict the
    first run keeps is the runtime's probe's, and greedy runs open the spare-row stack iff it holds."""
    probe = rows_exact_here(Generator.open(int4, config=SessionConfig(threads=2, exact=True)).engine)
    args = ["run", str(int4), "--prompt-ids", PROMPT, "--max-new-tokens", "8", "--temperature", "0", "--threads",
            "2", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)["token_ids"]
    kept = recall(memo_key(int4, 2))
    assert kept is not None and (kept.exact, kept.diff) == probe
    assert main(args) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["token_ids"] == first  # the second run (remembered) decodes as the first did
    assert ("(remembered in" in out.err) == (not kept.exact)
    _bench_stack(int4)
    assert json.loads(capsys.readouterr().out)["stack"] == ("stack" if kept.exact else "stack_lone")


def test_a_remembered_no_opens_the_lone_stack_and_keeps_speculation_off(fp32: Path, capsys) -> None:
    manifest = read_manifest(fp32)
    gen, known = open_generator(fp32, manifest, SessionConfig(threads=2), "auto", 0.0, "auto")
    assert known == Verdict(True, 0.0) and gen.engine.stack_role == "stack"  # fp32 on x86: measured exact
    remember(memo_key(fp32, 2), Verdict(False, 0.5), fp32)  # as a CPU whose kernels differ would have found
    gen, known = open_generator(fp32, manifest, SessionConfig(threads=2), "auto", 0.0, "auto")
    assert known == Verdict(False, 0.5, remembered=True) and gen.engine.stack_role == "stack_lone"
    assert main(["run", str(fp32), "--prompt-ids", PROMPT + "," + PROMPT, "--max-new-tokens", "4", "--temperature",
                 "0", "--threads", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert "speculative" not in json.loads(out.out)["stats"]  # auto: off
    assert "a verification row 0.5 away from a decode step (remembered in" in out.err
    assert "decoding through the lone-row stack" in out.err
    _bench_stack(fp32, "--exact-decode", "on")  # asked for: the spare-row stack all the same
    assert json.loads(capsys.readouterr().out)["stack"] == "stack"
    _bench_stack(fp32)
    assert json.loads(capsys.readouterr().out)["stack"] == "stack_lone"


def test_greedy_decoding_that_cannot_speculate_needs_no_spare_row(fp32: Path) -> None:
    manifest = read_manifest(fp32)
    gen, known = open_generator(fp32, manifest, SessionConfig(threads=2), "auto", 0.0, "off")
    assert known is None and gen.engine.stack_role == "stack_lone" and recall(memo_key(fp32, 2)) is None
    gen, known = open_generator(fp32, manifest, SessionConfig(threads=2), "on", 0.0, "off")
    assert gen.engine.stack_role == "stack"
