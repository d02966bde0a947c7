"""Chat models: templates render and tokenize as Hugging Face `transformers` does (the reference), export finds
and ships the template and every end-of-generation id, `Generator.chat` reuses the cached prefix of a
conversation exactly, any of the manifest's eos_ids ends generation, and `edgellm run --chat` works end to end
(an HF Qwen2 checkpoint with tokenizer.json, tokenizer_config.json and generation_config.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from edgellm.cli import main
from edgellm.loaders import load_checkpoint
from edgellm.runtime import Generator
from edgellm.runtime.chat import ChatTemplate
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.manifest import FORMAT_VERSION
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.tokenizer import HFTokenizer
from tests.runtime_fixtures import bigram_export, manifest_json
from tests.test_loaders_hf import save_hf

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "<|eot_id|>", "<|start_header_id|>",
            "<|end_header_id|>"]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# alternation enforced with raise_exception; loop controls, namespace, tojson and a generation block
STRICT = """{% set ns = namespace(n=0) %}
{% for message in messages %}
  {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
    {{ raise_exception('roles must alternate user/assistant') }}
  {% endif %}
  {% if message['role'] == 'user' %}
    {% set ns.n = ns.n + 1 %}
[INST] {{ message['content'] | tojson }} [/INST]
  {% else %}
{% generation %}{{ message['content'] }}{% endgeneration %}{{ eos_token }}
  {% endif %}
  {% if ns.n > 2 %}{% break %}{% endif %}
{% endfor %}"""
# whitespace control, attribute access, loop.last, an optional `tools` variable and tojson of a dict
TRIMMED = """{%- if tools %}
    {{- '<|im_start|>system\ntools: ' + (tools | tojson) + '<|im_end|>\n' }}
{%- elif messages[0].role != 'system' %}
    {{- '<|im_start|>system\nDefault.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + message.content | trim }}
    {%- if not loop.last or message.role != 'assistant' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' + ({'a': 1} | tojson) + '\n' }}{%- endif %}
"""
CONVERSATION = [{"role": "user", "content": "Hi there, what is 2+2? «ünïcode»"},
                {"role": "assistant", "content": "  It is 4.  "},
                {"role": "user", "content": "And 3+3?"}]


def chat_tokenizer(path: Path) -> Tokenizer:
    """Byte-level BPE without merges (one token per byte) plus chat control tokens; ids 0-6 are SPECIALS."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIALS + alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat-tok") / "tokenizer.json"
    chat_tokenizer(path)
    return path


def reference(tok_path: Path, template: str, messages, **kw):
    """transformers' rendering and ids of `messages`."""
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_path), bos_token="<s>", eos_token="<|im_end|>")
    ref.chat_template = template
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    return text, list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("template", [CHATML, LLAMA3, STRICT, TRIMMED], ids=["chatml", "llama3", "strict", "trimmed"])
def test_render_and_ids_match_transformers(tok_path, template):
    tok = HFTokenizer.from_file(tok_path, bos_id=3, eos_id=2)
    ours = ChatTemplate(template, "test", "<s>", "<|im_end|>")
    for messages in (CONVERSATION[:1], CONVERSATION):
        want_text, want_ids = reference(tok_path, template, messages)
        text = ours.render(messages)
        assert text == want_text
        assert tok.encode_template(text) == want_ids
    # control tokens typed by a user stay text in a plain prompt; in a rendered template they are tokens
    assert 2 in tok.encode_template("<|im_end|>") and 2 not in tok.encode("<|im_end|>")


def test_template_errors_are_one_line(tok_path):
    with pytest.raises(EdgeError, match="roles must alternate"):
        ChatTemplate(STRICT, "t").render([{"role": "assistant", "content": "x"}])
    with pytest.raises(EdgeError, match="not a valid Jinja chat template"):
        ChatTemplate("{% for %}", "t")
    with pytest.raises(EdgeError, match="rendering failed"):  # the sandbox: no attribute walking
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", "t").render(CONVERSATION)
    with pytest.raises(EdgeError, match=r"messages\[0\]: expected"):
        ChatTemplate(CHATML, "t").render([{"role": "user"}])
    with pytest.raises(EdgeError, match="role: expected one of"):
        ChatTemplate(CHATML, "t").render([{"role": "robot", "content": "x"}])


# ------------------------------------------------------------------------------------ HF checkpoint to run


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory, tok_path) -> Path:
    """A Qwen2 checkpoint (transformers, random weights) whose tokenizer_config.json holds the ChatML template
    and whose generation_config.json lists <|im_end|> and <|endoftext|>, exported with `edgellm export`."""
    root = tmp_path_factory.mktemp("chat-hf")
    save_hf("qwen2", root / "hf", vocab_size=272, bos_token_id=3, eos_token_id=2)
    shutil.copy(tok_path, root / "hf" / "tokenizer.json")
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    (root / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert main(["export", str(root / "hf"), "-o", str(root / "exp"), "--max-seq", "256", "--prefill-chunk", "16",
                 "--no-progress"]) == 0
    return root / "exp"


def test_export_ships_template_and_eos_ids(hf_export, capsys):
    assert main(["info", str(hf_export)]) == 0
    assert "eos 2, 0; chat template chat_template.jinja (run --chat)" in capsys.readouterr().out
    doc = manifest_json(hf_export)
    assert doc["format_version"] == FORMAT_VERSION and (doc["eos_id"], doc["eos_ids"]) == (2, [2, 0])
    assert doc["tokenizer"] == {"file": "tokenizer.json.xz", "kind": "hf", "chat_template": "chat_template.jinja",
                                "add_bos": False}  # a Qwen-style tokenizer.json: no post-processor, no BOS
    assert (hf_export / "chat_template.jinja").read_text() == CHATML
    assert load_checkpoint(hf_export.parent / "hf").config.end_ids == (0,)


def test_quantized_export_keeps_the_template(hf_export, tmp_path):
    assert main(["quantize", str(hf_export), "-o", str(tmp_path / "q"), "--bits", "8", "--no-progress"]) == 0
    gen = Generator.open(tmp_path / "q")
    assert gen.chat_template is not None and gen.eos_ids == {0, 2}


def test_chat_reuses_the_cached_prefix_exactly(hf_export):
    greedy, stop = SamplingParams(temperature=0), StopParams(8, seed=0)
    gen = Generator.open(hf_export, threads=1)
    first = list(gen.chat(CONVERSATION[:1], greedy, stop))[-1]
    messages = CONVERSATION[:1] + [{"role": "assistant", "content": first.text}, CONVERSATION[2]]
    full = gen.chat_ids(messages)
    second = list(gen.chat(messages, greedy, stop))[-1]
    assert second.timings.prompt_tokens <= len(full) - len(gen.chat_ids(CONVERSATION[:1]))  # turn 1 was cached
    fresh = Generator.open(hf_export, threads=1)
    again = list(fresh.chat(messages, greedy, stop))[-1]
    assert again.timings.prompt_tokens == len(full)
    assert second.token_ids == again.token_ids and len(second.token_ids) > 0
    same_cache(gen, fresh)
    # an edited earlier turn rewinds to where the conversations part: the cache then holds what a fresh run's does
    edited = [{"role": "user", "content": "Hi there"}] + messages[1:]
    third = list(gen.chat(edited, greedy, stop))[-1]
    fresh = Generator.open(hf_export, threads=1)
    assert third.token_ids == list(fresh.chat(edited, greedy, stop))[-1].token_ids
    same_cache(gen, fresh)


def same_cache(a: Generator, b: Generator) -> None:
    """Both generators hold the same context: as many rows, equal to rounding (stale rows would differ by O(1))."""
    n = a.cache.length
    assert n == b.cache.length
    for ka, kb in zip(a.cache.keys + a.cache.values, b.cache.keys + b.cache.values, strict=True):
        np.testing.assert_allclose(ka[:, :, :n], kb[:, :, :n], atol=1e-4, rtol=0)


def test_any_eos_id_ends_generation(tmp_path_factory, tmp_path):
    """The bigram export walks a fixed chain of tokens: listing its second token as an eos id stops it there."""
    src = bigram_export(tmp_path_factory)
    shutil.copytree(src, tmp_path / "e")
    greedy = SamplingParams(temperature=0)
    chain = Generator.open(tmp_path / "e").complete("a", greedy).token_ids
    doc = manifest_json(tmp_path / "e")
    doc["eos_ids"] = [doc["eos_id"], chain[1]]
    (tmp_path / "e" / "manifest.json").write_text(json.dumps(doc))
    result = Generator.open(tmp_path / "e").complete("a", greedy)
    assert (result.token_ids, result.finish_reason) == (chain[:1], "eos")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_chat(hf_export, capsys, monkeypatch):
    code, out, err = run(capsys, "run", str(hf_export), "--chat", "--system", "Be brief.", "--prompt", "Hi",
                         "--temperature", "0", "--max-new-tokens", "5", "--json")
    doc = json.loads(out)
    want = Generator.open(hf_export).chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                          SamplingParams(temperature=0), StopParams(5, seed=0))
    assert code == 0 and doc["token_ids"] == list(want)[-1].token_ids
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("Hi\nAnd then?\n"))
    code, out, err = run(capsys, "run", str(hf_export), "--chat", "--interactive", "--temperature", "0",
                         "--max-new-tokens", "4")
    assert code == 0 and len([s for s in err.splitlines() if "TTFT" in s]) == 2
    assert "chat template" not in err
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("Hi\n"))
    code, out, err = run(capsys, "run", str(hf_export), "--interactive", "--max-new-tokens", "2")
    assert code == 0 and "this export has a chat template: --chat" in err.splitlines()[0]


@pytest.mark.parametrize("argv,match", [
    (["--chat", "--prompt-ids", "1,2"], "--chat: takes --prompt text"),
    (["--system", "x", "--prompt", "a"], "--system: needs --chat"),
    (["--chat", "--prompt", "a"], "has no chat template"),
])
def test_cli_chat_errors(tmp_path_factory, capsys, argv, match):
    code, out, err = run(capsys, "run", str(bigram_export(tmp_path_factory)), *argv)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1
