"""`edgellm run` and `edgellm bench` from the command line: output formats, flag errors, interactive mode."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from edgellm.cli import main
from edgellm.runtime import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams
from tests.runtime_fixtures import CHAIN, bigram_export, tiny_export

STATS_KEYS = {"prompt_tokens", "new_tokens", "ttft_s", "prefill_tok_s", "decode_s", "decode_tok_s", "decode_run_s",
              "overhead_pct", "peak_rss_mb"}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return str(bigram_export(tmp_path_factory))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_schema(export, capsys):
    code, out, err = run(capsys, "run", export, "--prompt", "a", "--temperature", "0", "--json", "--threads", "1")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert list(doc) == ["schema", "version", "text", "token_ids", "finish_reason", "prompt_ids", "stats"]
    assert (doc["schema"], doc["version"], doc["text"], doc["finish_reason"]) == ("edgellm-run", 2, CHAIN, "eos")
    assert doc["prompt_ids"] == Generator.open(export).encode("a") and doc["prompt_ids"][0] == 1  # BOS, then "a"
    assert len(doc["token_ids"]) == 6 and set(doc["stats"]) == STATS_KEYS | {"speculative"}  # lookup by default
    assert set(doc["stats"]["speculative"]) == {"mode", "drafted", "accepted", "verifications"}
    assert doc["stats"]["prompt_tokens"] == 2


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_text_then_one_stats_line(export, capsys, stream):
    code, out, err = run(capsys, "run", export, "--prompt", "a", "--temperature", "0", stream)
    assert code == 0 and out == CHAIN + "\n"
    (line,) = err.strip().splitlines()
    for part in ("[eos]", "prompt 2 tok", "TTFT", "prefill", "decode", "tok/s", "peak RSS"):
        assert part in line


def test_prompt_ids_and_stop(export, capsys):
    ids = ",".join(map(str, Generator.open(export).encode("a")))
    code, out, _ = run(capsys, "run", export, "--prompt-ids", ids, "--temperature", "0", "--stop", "中")
    assert code == 0 and out == "é\n"


def test_sampler_defaults_come_from_the_manifest(tmp_path_factory, capsys):
    directory, _ = tiny_export(tmp_path_factory, "llama2", "layer")
    gen = Generator.open(directory)
    assert gen.default_sampling.temperature > 0  # the export's defaults sample
    prompt = [5, 17, 33, 2, 9]
    want = gen.complete(prompt, None, StopParams(max_new_tokens=12, seed=11))
    code, out, _ = run(capsys, "run", str(directory), "--prompt-ids", "5,17,33,2,9", "--seed", "11",
                       "--max-new-tokens", "12", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["token_ids"] == want.token_ids and doc["text"] == ""
    greedy = gen.complete(prompt, SamplingParams(temperature=0), StopParams(max_new_tokens=12))
    assert greedy.token_ids != want.token_ids  # so the defaults really were not greedy


@pytest.mark.parametrize(("flags", "message"), [
    (["--temperature", "-1"], "--temperature: expected a number >= 0"),
    (["--top-p", "0"], "--top-p: expected a number in (0, 1]"),
    (["--top-k", "-1"], "--top-k: expected an integer >= 0"),
    (["--max-new-tokens", "-1"], "--max-new-tokens: expected an integer >= 0"),
    (["--min-p", "1"], "--min-p: expected a number in [0, 1)"),
    (["--threads", "0"], "--threads: expected an integer in 1..256"),
    (["--threads", "100000"], "--threads: expected an integer in 1..256"),
    (["--temperature", "hot"], "--temperature: expected a number, got 'hot'"),
    (["--max-new-tokens", "1.5"], "--max-new-tokens: expected an integer, got '1.5'"),
    (["--prompt-ids", "1,x"], "--prompt-ids: expected comma-separated integers"),
    (["--prompt-ids", "1,999"], "--prompt-ids: token ids must be in [0, 259)"),
])
def test_bad_flags_exit_2_with_one_line(export, capsys, flags, message):
    argv = ["run", export, *flags] + ([] if "--prompt-ids" in flags else ["--prompt", "a"])
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"edgellm run: error: {message}")
    assert "Traceback" not in err


def test_empty_prompt_and_missing_prompt(export, capsys):
    for argv, message in ((["--prompt", ""], "--prompt: expected a non-empty prompt"),
                          ([], "expected --prompt TEXT, --prompt-ids IDS or --interactive")):
        code, _, err = run(capsys, "run", export, *argv)
        assert code == 2 and err == f"edgellm run: error: {message}\n"


def test_not_an_export(tmp_path, capsys):
    code, _, err = run(capsys, "run", str(tmp_path), "--prompt", "a")
    assert code == 2 and "manifest.json: not found" in err and err.count("\n") == 1


def test_interactive_keeps_the_context_then_resets(export, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("a\n\na\n" + "a\n" * 8))
    code, out, err = run(capsys, "run", export, "--interactive", "--temperature", "0")
    assert code == 0
    assert out.splitlines()[:2] == [CHAIN, CHAIN]  # the second turn ("\na") continues the first
    assert "[context full: starting a new context]" in err  # 10 turns of 8 tokens overflow 64 rows
    assert err.count("[eos]") == 10 and "error" not in err  # the blank line is skipped


def test_bench_json(export, capsys):
    code, out, _ = run(capsys, "bench", export, "--runs", "1", "--new-tokens", "4", "--contexts", "3,8",
                       "--threads", "1", "--json", "--max-other-load", "100")
    assert code == 0
    doc = json.loads(out)
    assert (doc["schema"], doc["version"], doc["threads"], doc["new_tokens"]) == ("edgellm-bench", 1, 1, 4)
    assert [r["context"] for r in doc["rows"]] == [3, 8]
    row = doc["rows"][0]
    assert row["system"] == "edgellm" and row["decode_tok_s"]["median"] > 0 and row["peak_rss_mb"] > 0
    assert 0 <= row["overhead_pct"]["median"] < 100
    assert doc["stack"] == "stack"  # greedy: the exact stack; --exact-decode off: the lone-row one (format 13)
    code, out, _ = run(capsys, "bench", export, "--runs", "1", "--new-tokens", "4", "--contexts", "3", "--threads",
                       "1", "--json", "--max-other-load", "100", "--exact-decode", "off")
    assert code == 0 and json.loads(out)["stack"] == "stack_lone"


@pytest.mark.parametrize("argv", [["info"], ["run", "--prompt", "a", "--temperature", "0"]], ids=["info", "run"])
def test_a_closed_pipe_is_quiet(export, argv):
    """`edgellm info DIR | head -1`, `edgellm run ... | head -c 10`: the reader goes away; no traceback, no error
    line, SIGPIPE's exit code."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    proc = subprocess.Popen([sys.executable, "-m", "edgellm", argv[0], export, *argv[1:]], stdout=write,
                            stderr=subprocess.PIPE)
    os.close(write)
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (141, b"")
