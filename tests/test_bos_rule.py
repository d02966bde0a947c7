"""Text becomes the ids the checkpoint's own tokenizer gives: BOS in front exactly when `transformers`'
`AutoTokenizer.from_pretrained(dir)(text).input_ids` has it (Llama/Mistral/Llama 3 yes; Qwen2/Qwen3/SmolLM2 no),
through `edgellm export` (manifest tokenizer.add_bos), `edgellm run --prompt/--chat/--interactive` (--json
prompt_ids), `edgellm diff --text`, and greedy generation equal to transformers' `generate`."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from edgellm.cli import main
from edgellm.export.bos_rule import add_bos_rule, checkpoint_add_bos, post_processor_affixes, rule_notes
from edgellm.runtime import Generator
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.manifest import read_manifest
from edgellm.train.bpe import train_bpe_from_iterator
from tests.test_chat import LLAMA3
from tests.test_loaders_hf import save_hf

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|begin_of_text|>",  # ids 0-5
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ["The capital of France is Paris.", "Once upon a time a small cat sat on a warm mat.",
          "Café naïve résumé, 中文 and 🙂 too.", "hello world, hello again"] * 30
TEXTS = ["The capital of France is", " leading space", "Café 中文 🙂 naïve", "a\nb  c", "x"]
VOCAB = 320  # the models' rows: the trained tokenizer has at most 300


def bpe(post: str) -> Tokenizer:
    """A byte-level BPE trained here, with the post-processor of one tokenizer style."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = {"llama2": ("<s>", 3), "llama3": ("<|begin_of_text|>", 5)}
    if post in template:
        bos, bos_id = template[post]
        tp = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), tp]) if post == "llama3" else tp
    elif post == "qwen":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


# style -> (post-processor, tokenizer_config.json, config bos/eos ids): as the real checkpoints ship them
STYLES = {
    "llama2": ("llama2", {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                          "add_bos_token": True, "add_eos_token": False}, (3, 4)),
    "llama3": ("llama3", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                          "eos_token": "<|im_end|>", "chat_template": LLAMA3}, (5, 2)),
    "qwen": ("qwen", {"tokenizer_class": "Qwen2TokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
                      "add_bos_token": False}, (0, 2)),
    "smollm2": ("none", {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
                (1, 2)),
    # add_bos_token disagrees with tokenizer.json: transformers 5 follows tokenizer.json, and so does edgellm
    "disagree": ("llama2", {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                            "add_bos_token": False}, (3, 4)),
}
# (family, style, adds BOS): every HF family edgellm loads, with and without a BOS
CASES = [("llama", "llama2", True), ("mistral", "llama2", True), ("llama", "llama3", True), ("qwen2", "qwen", False),
         ("qwen3", "qwen", False), ("llama", "smollm2", False), ("llama", "disagree", True)]


def write_tokenizer(directory: Path, style: str) -> None:
    post, config, _ = STYLES[style]
    directory.mkdir(parents=True, exist_ok=True)
    bpe(post).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def reference_ids(directory: Path, text: str) -> list[int]:
    return list(transformers.AutoTokenizer.from_pretrained(str(directory))(text).input_ids)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Path, torch.nn.Module]]:
    """(family, style) -> (HF dir, its `edgellm export`, the transformers model), built once."""
    root = tmp_path_factory.mktemp("bos")
    built = {}
    for family, style, _ in CASES:
        hf, out = root / f"{family}-{style}", root / f"{family}-{style}-exp"
        bos, eos = STYLES[style][2]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = save_hf(family, hf, vocab_size=VOCAB, bos_token_id=bos, eos_token_id=eos)
            with torch.no_grad():  # sharper attention than the 0.02-std init, so a leading BOS changes the output
                for p in model.parameters():
                    if p.dim() == 2:
                        p.mul_(4.0)
            model.save_pretrained(hf)
        write_tokenizer(hf, style)
        assert main(["export", str(hf), "-o", str(out), "--max-seq", "128", "--prefill-chunk", "8",
                     "--no-progress"]) == 0
        built[(family, style)] = hf, out, model
    return built


def cli_json(capsys, *argv: str) -> list[dict]:
    assert main(["run", *argv, "--json", "--temperature", "0", "--threads", "1"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("style", list(STYLES))
def test_rule_agrees_with_transformers(tmp_path, style):
    write_tokenizer(tmp_path, style)
    bos = STYLES[style][2][0]
    ids = reference_ids(tmp_path, "hello world")
    assert add_bos_rule(tmp_path / "tokenizer.json", bos) == (ids[0] == bos)
    assert (ids[0] == bos) == (style in ("llama2", "llama3", "disagree"))


def test_disagreeing_add_bos_token_is_noted(tmp_path):
    write_tokenizer(tmp_path, "disagree")
    (note,) = rule_notes(tmp_path / "tokenizer.json", True)
    assert "add_bos_token=false" in note and "as transformers >= 5 does" in note
    write_tokenizer(tmp_path, "llama2")
    assert rule_notes(tmp_path / "tokenizer.json", True) == []


def write_post(tmp_path: Path, post: processors.PostProcessor | None) -> Path:
    tok = bpe("none")
    tok.post_processor = post
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_other_processors(tmp_path):
    roberta = write_post(tmp_path, processors.RobertaProcessing(("</s>", 4), ("<s>", 3)))
    assert post_processor_affixes(roberta) == ([3], [4]) and add_bos_rule(roberta, 3)
    assert any("appends ids [4]" in n for n in rule_notes(roberta, True))
    bert = write_post(tmp_path, processors.BertProcessing(("</s>", 4), ("<s>", 3)))
    assert add_bos_rule(bert, 3)
    suffix_only = write_post(tmp_path, processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 4)]))
    assert post_processor_affixes(suffix_only) == ([], [4]) and not add_bos_rule(suffix_only, 3)
    assert reference_ids(tmp_path, "hi")[-1] == 4  # transformers appends it; a prompt does not get it (noted)
    other = write_post(tmp_path, processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]))
    with pytest.raises(EdgeError, match=r"puts ids \[1\] before the text, but the model's BOS is 3"):
        add_bos_rule(other, 3)
    two = write_post(tmp_path, processors.TemplateProcessing(single="<s> <s> $A", special_tokens=[("<s>", 3)]))
    with pytest.raises(EdgeError, match="puts 2 ids"):
        add_bos_rule(two)
    doc = json.loads(two.read_text())
    doc["post_processor"] = {"type": "Mystery"}
    two.write_text(json.dumps(doc))
    with pytest.raises(EdgeError, match="unknown type 'Mystery'"):
        add_bos_rule(two, 3)
    assert add_bos_rule(tmp_path / "tokenizer.bin") is True  # llama2.c: always, as run.c


def test_edgellm_checkpoints_keep_bos(tmp_path):
    """edgellm trains every document as BOS ids EOS: its checkpoints add BOS whatever the tokenizer file says,
    and the BPE tokenizers it trains say so to transformers too."""
    qwen = tmp_path / "q"
    write_tokenizer(qwen, "qwen")
    assert checkpoint_add_bos("edgellm", qwen / "tokenizer.json", 0) is True
    assert checkpoint_add_bos("hf", qwen / "tokenizer.json", 0) is False
    assert checkpoint_add_bos("edgellm", None, None) is False
    trained = tmp_path / "t"
    trained.mkdir()
    (trained / "tokenizer.json").write_text(train_bpe_from_iterator(CORPUS, 300).tok.to_str())
    (trained / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    assert add_bos_rule(trained / "tokenizer.json", 1) and reference_ids(trained, "hello")[0] == 1


# --------------------------------------------------------------------------------- through the CLI


@pytest.mark.slow
@pytest.mark.parametrize(("family", "style", "adds"), CASES)
def test_run_prompt_ids_equal_transformers(exports, capsys, family, style, adds):
    hf, out, _ = exports[(family, style)]
    assert read_manifest(out).add_bos is adds
    for text in TEXTS:
        (doc,) = cli_json(capsys, str(out), "--prompt", text, "--max-new-tokens", "1")
        want = reference_ids(hf, text)
        assert doc["prompt_ids"] == want, text
        assert (want[0] == STYLES[style][2][0]) is adds
    main(["info", str(out)])
    assert ("put in front of text prompts" in capsys.readouterr().out) is adds
    main(["info", str(hf)])
    assert f"(BOS {'put' if adds else 'not put'} in front of text prompts)" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(("family", "style"), [("llama", "llama2"), ("qwen2", "qwen")])
def test_greedy_equals_transformers_generate(exports, capsys, family, style):
    hf, out, model = exports[(family, style)]
    bos, eos = STYLES[style][2]

    def generate(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)[0, ids.shape[1]:].tolist()
        return new[:new.index(eos)] if eos in new else new

    other = 0  # texts whose continuation changes with the BOS choice: the test can tell the rules apart
    for text in TEXTS[:3]:
        (doc,) = cli_json(capsys, str(out), "--prompt", text, "--max-new-tokens", "10")
        ids = reference_ids(hf, text)
        want = generate(ids)
        assert doc["token_ids"] == want and len(want) > 0, text
        flipped = ids[1:] if ids[0] == bos else [bos, *ids]
        other += generate(flipped) != want
    assert other > 0


@pytest.mark.slow
def test_quantize_keeps_the_rule(exports, tmp_path):
    _, out, _ = exports[("qwen2", "qwen")]
    assert main(["quantize", str(out), "-o", str(tmp_path / "q"), "--bits", "8", "--no-progress", "--no-check"]) == 0
    assert read_manifest(tmp_path / "q").add_bos is False
    assert Generator.open(tmp_path / "q").encode("The capital") == Generator.open(out).encode("The capital")


@pytest.mark.slow
def test_chat_has_one_bos_as_transformers(exports, capsys):
    """The Llama 3 template renders bos_token itself: the conversation's ids are apply_chat_template's, with
    one BOS, though the tokenizer also adds BOS to plain text."""
    hf, out, _ = exports[("llama", "llama3")]
    ref = transformers.AutoTokenizer.from_pretrained(str(hf))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café, 中文?"}]
    want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert want.count(5) == 1 and want[0] == 5
    assert Generator.open(out).chat_ids(messages) == want
    (doc,) = cli_json(capsys, str(out), "--chat", "--system", "Be brief.", "--prompt", "Café, 中文?",
                      "--max-new-tokens", "1")
    assert doc["prompt_ids"] == want


@pytest.mark.slow
@pytest.mark.parametrize(("family", "style"), [("llama", "llama2"), ("qwen2", "qwen")])
def test_interactive_first_line_as_transformers(exports, capsys, monkeypatch, family, style):
    hf, out, _ = exports[(family, style)]
    monkeypatch.setattr("sys.stdin", io.StringIO("The capital of France is\nx\n"))
    first, second = cli_json(capsys, str(out), "--interactive", "--max-new-tokens", "2")
    assert first["prompt_ids"] == reference_ids(hf, "The capital of France is")
    # a later turn continues the context: "\n" + the line, never a BOS, after the carried-over token
    assert second["prompt_ids"][1:] == Generator.open(out).tokenizer.encode("\nx")


@pytest.mark.slow
@pytest.mark.parametrize(("family", "style"), [("llama", "llama2"), ("qwen2", "qwen")])
def test_diff_text_tokens_as_transformers(exports, tmp_path, family, style):
    hf, out, _ = exports[(family, style)]
    text = " ".join(CORPUS[:4])
    (tmp_path / "eval.txt").write_text(text, encoding="utf-8")
    assert main(["diff", str(hf), str(out), "-o", str(tmp_path / "r"), "--text", str(tmp_path / "eval.txt"),
                 "--tokens", "40", "--prompts", "1", "--quiet"]) == 0
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["text"]["tokens"] == reference_ids(hf, text)[:40]
