"""The tokenizer rebuilt from a GGUF's metadata gives transformers' GGUF tokenizer's ids (BOS included or not,
per the file) for both vocabulary kinds, decodes as it does through edgellm's runtime, and its
tokenizer_config.json carries add_bos_token, the special tokens and the chat template."""

from __future__ import annotations

import json

import pytest
import tokenizers

from edgellm.export.tokenizer_files import find_chat_template
from edgellm.loaders.gguf_file import GGUFFile
from edgellm.loaders.gguf_tokenizer import write_tokenizer
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.tokenizer import load_tokenizer
from tests.gguf_helpers import (
    TEMPLATE,
    TEXTS,
    bpe_vocab,
    gemma_vocab,
    hf_model,
    reference,
    spm_vocab,
    transformers,
    write_gguf,
)

CASES = {  # name -> (vocab builder, metadata overrides, BOS added?)
    "bpe-gpt2-regex": (lambda: bpe_vocab(pre="smollm"), {}, False),
    "bpe-qwen2-regex": (lambda: bpe_vocab(pre="qwen2"), {}, False),
    "bpe-add-bos": (bpe_vocab, {"tokenizer.ggml.add_bos_token": True}, True),
    "spm-scores": (spm_vocab, {}, True),  # no add_bos_token key: a llama vocabulary adds BOS
    "spm-no-bos": (spm_vocab, {"tokenizer.ggml.add_bos_token": False}, False),
    # Gemma: no prefix space ("The" is `The`, not `▁The`), merges ranked by file position, not by score
    "spm-gemma": (gemma_vocab, {"tokenizer.ggml.add_space_prefix": False}, True),
}
ARCH = {"spm-gemma": "gemma3"}


def _files(tmp_path, case):
    build, meta, _ = CASES[case]
    v = build()
    path = write_gguf(tmp_path / "t.gguf", hf_model("qwen2", len(v["tokens"])), "qwen2", v, meta=meta,
                      arch=ARCH.get(case))
    with GGUFFile(path) as g:
        tok_json = write_tokenizer(g)
    return path, tok_json, v


@pytest.mark.parametrize("case", list(CASES))
def test_ids_match_transformers(tmp_path, case):
    path, tok_json, v = _files(tmp_path, case)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = tokenizers.Tokenizer.from_file(str(tok_json))
    for text in TEXTS + ["The end", "runs   of    spaces"]:
        want = ref(text).input_ids
        assert ours.encode(text).ids == want, text
        assert want == [v["bos"]] * CASES[case][2] + ref(text, add_special_tokens=False).input_ids, text
        assert ours.decode(want, skip_special_tokens=True) == ref.decode(want, skip_special_tokens=True), text
    config = json.loads((tok_json.parent / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is CASES[case][2]
    assert (config["bos_token"], config["eos_token"]) == (v["tokens"][v["bos"]], v["tokens"][v["eos"]])


@pytest.mark.parametrize("case", ["bpe-gpt2-regex", "spm-scores"])
def test_runtime_tokenizer_decodes_like_transformers(tmp_path, case):
    """edgellm's runtime (no BOS, its own byte-exact decoding) on the written tokenizer.json; control tokens
    typed in a prompt are text to the runtime by design, so those texts go through encode_template."""
    path, tok_json, _ = _files(tmp_path, case)
    _, ref = reference(path)
    runtime = load_tokenizer(tok_json, len(ref), bos_id=1, eos_id=2)
    for text in TEXTS[:-1]:
        ids = runtime.encode_template(text) if "<|" in text else runtime.encode(text)
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        assert runtime.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_chat_template_ships_beside_the_tokenizer(tmp_path):
    _, tok_json, _ = _files(tmp_path, "bpe-gpt2-regex")
    template, where = find_chat_template(tok_json)
    assert template == TEMPLATE and where.endswith("tokenizer_config.json: chat_template")


def test_unknown_tokenizer_model_is_refused(tmp_path):
    v = {**bpe_vocab(), "model": "rwkv"}
    path = write_gguf(tmp_path / "t.gguf", hf_model("qwen2", len(v["tokens"])), "qwen2", v)
    with GGUFFile(path) as g, pytest.raises(EdgeError, match="tokenizer.ggml.model 'rwkv' is not supported"):
        write_tokenizer(g)
