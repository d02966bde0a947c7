"""Whether a text prompt starts with BOS: the checkpoint's tokenizer decides, and export records its answer.

The reference is Hugging Face `transformers` (5.x): `AutoTokenizer.from_pretrained(dir)(text).input_ids`.
  * tokenizer.json: its `post_processor` decides. A BOS is added when the processor puts one token before
    the text: `TemplateProcessing` whose `single` starts with a special token, `RobertaProcessing` /
    `BertProcessing` (their `cls`), or a `Sequence` holding one of those (Llama 3: ByteLevel, then a
    template). None, `ByteLevel`, or a template that starts with `$A` (Qwen2/2.5/3, SmolLM2): no BOS.
  * tokenizer_config.json's `add_bos_token` does NOT count when a tokenizer.json exists: transformers 5
    drops it on load (`_from_pretrained`) and keeps tokenizer.json's post-processor, and with no
    post-processor it adds nothing whatever `add_bos_token` says. (transformers 4's LlamaTokenizerFast
    rebuilt the processor from `add_bos_token`; real checkpoints save the two consistently.) When they
    disagree, export logs a note (`rule_notes`) and follows tokenizer.json.
  * llama2.c tokenizer.bin: always (run.c puts BOS=1 in front of every prompt).
  * edgellm's own checkpoints: whenever the model has a BOS id: edgellm's trainer feeds every document as
    BOS ids EOS (edgellm/train/data.py), whatever tokenizer.json it was given. (The BPE tokenizers it
    trains also carry a "<bos> $A" template, so transformers agrees on them.)
Tokens a processor appends after the text (an EOS) are not reproduced: a prompt is text to continue; export
logs a note. A prefix other than the model's one BOS id cannot be reproduced either: EdgeError.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.tokenizer import tokenizer_kind


def add_bos_rule(tokenizer_path: Path, bos_id: int | None = None) -> bool:
    """Whether text prompts get BOS in front, as the tokenizer file defines it (see the module docstring).
    With `bos_id`, a prefix that is not exactly that one id is an EdgeError naming both."""
    path = Path(tokenizer_path)
    if tokenizer_kind(path) == "llama2c":
        return True
    prefix, _ = post_processor_affixes(path)
    if not prefix:
        return False
    need(bos_id is None or prefix == [bos_id],
         f"{path}: its post_processor puts ids {prefix} before the text, but the model's BOS is {bos_id}; "
         "edgellm can only put that one BOS in front of a prompt")
    need(bos_id is not None or len(prefix) == 1,
         f"{path}: its post_processor puts {len(prefix)} ids {prefix} before the text; edgellm adds one BOS at most")
    return True


def checkpoint_add_bos(source: str, tokenizer_path: Path | None, bos_id: int | None) -> bool:
    """The rule for a loaded checkpoint (`Loaded.source`, `.tokenizer_path`, `.config.bos_id`): edgellm's own
    checkpoints were trained with BOS first; every other source asks its tokenizer file."""
    if bos_id is None:
        return False
    if source == "edgellm":
        return True
    return add_bos_rule(tokenizer_path, bos_id) if tokenizer_path is not None else False


def rule_notes(tokenizer_path: Path, add_bos: bool) -> list[str]:
    """What export tells the user about the rule: tokens appended after the text that a prompt will not get,
    and a tokenizer_config.json `add_bos_token` that disagrees with the rule (transformers ignores it too)."""
    path = Path(tokenizer_path)
    if tokenizer_kind(path) != "hf":
        return []
    notes = []
    _, suffix = post_processor_affixes(path)
    if suffix:
        notes.append(f"note: {path.name}'s post_processor appends ids {suffix} after the text; prompts do not "
                     "get them (a prompt is text to continue)")
    config = _json(path.with_name("tokenizer_config.json"), missing_ok=True)
    flag = config.get("add_bos_token") if isinstance(config, dict) else None
    if isinstance(flag, bool) and flag != add_bos:
        notes.append(f"note: tokenizer_config.json says add_bos_token={str(flag).lower()}, but {path.name}'s "
                     f"post_processor {'adds' if add_bos else 'adds no'} BOS; prompts follow {path.name}, as "
                     "transformers >= 5 does")
    return notes


def post_processor_affixes(path: Path) -> tuple[list[int], list[int]]:
    """(ids put before the text, ids put after it) by tokenizer.json's post_processor, for one sequence."""
    doc = _json(path)
    need(isinstance(doc, dict), f"{path}: not a tokenizer.json (expected a JSON object)")
    return _affixes(doc.get("post_processor"), f"{path}: post_processor")


def _affixes(proc: object, where: str) -> tuple[list[int], list[int]]:
    if proc is None:
        return [], []
    need(isinstance(proc, dict), f"{where}: expected an object or null")
    kind = proc.get("type")
    try:
        if kind == "Sequence":  # applied in order: a later processor wraps what the earlier ones made
            prefix: list[int] = []
            suffix: list[int] = []
            for i, p in enumerate(proc["processors"]):
                pre, post = _affixes(p, f"{where}.processors[{i}]")
                prefix, suffix = pre + prefix, suffix + post
            return prefix, suffix
        if kind == "TemplateProcessing":
            specials = proc["special_tokens"]
            pieces = [next(iter(piece.items())) for piece in proc["single"]]  # {"SpecialToken"|"Sequence": {...}}
            at = next(i for i, (k, _) in enumerate(pieces) if k == "Sequence")
            ids = [[int(t) for t in specials[v["id"]]["ids"]] if k == "SpecialToken" else [] for k, v in pieces]
            return sum(ids[:at], []), sum(ids[at + 1:], [])
        if kind in ("RobertaProcessing", "BertProcessing"):  # [cls] text [sep]
            return [int(proc["cls"][1])], [int(proc["sep"][1])]
        if kind == "ByteLevel":
            return [], []
    except (KeyError, IndexError, TypeError, ValueError, StopIteration, AttributeError) as err:
        raise EdgeError(f"{where}: malformed {kind} ({type(err).__name__}: {err})") from None
    raise EdgeError(f"{where}: unknown type {kind!r} (expected TemplateProcessing, Sequence, RobertaProcessing, "
                    "BertProcessing or ByteLevel)")


def _json(path: Path, missing_ok: bool = False) -> object:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        if missing_ok:
            return None
        raise EdgeError(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise EdgeError(f"{path}: not readable JSON ({err})") from None
