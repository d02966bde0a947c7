"""The tokenizer side of an export: which tokenizer file ships, which chat template, which ids end generation.

A Hugging Face model keeps its chat template next to `tokenizer.json`: in `chat_template.jinja` (transformers
>= 4.43 saves it there) or as `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates,
of which "default" is the one `apply_chat_template` uses). Export checks the template renders a one-message
conversation with the tokenizer, as `edgellm run --chat` will, and ships it as `chat_template.jinja`.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgellm.model import ModelConfig
from edgellm.runtime.chat import ChatTemplate, read_text
from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, tokenizer_kind

from .bos_rule import add_bos_rule as add_bos_rule  # whether text prompts get BOS (bos_rule.py)

CHAT_TEMPLATE = "chat_template.jinja"  # its name in an export


def check_tokenizer(path: Path | None, cfg: ModelConfig) -> Tokenizer | None:
    """Load the tokenizer exactly as `edgellm run` will (Generator.open): a corrupt tokenizer, or one larger
    than the vocabulary, must fail here rather than ship inside an export that verifies but cannot run a prompt."""
    if path is None:
        return None
    return load_tokenizer(path, cfg.vocab_size, kind=tokenizer_kind(path), bos_id=cfg.bos_id, eos_id=cfg.eos_id)


def find_chat_template(tokenizer_path: Path | None) -> tuple[str, str] | None:
    """(template text, where it came from) beside a tokenizer.json, or None if the model has none."""
    if tokenizer_path is None or tokenizer_kind(tokenizer_path) != "hf":
        return None
    folder = Path(tokenizer_path).parent
    jinja = folder / CHAT_TEMPLATE
    if jinja.is_file():
        return read_text(jinja), str(jinja)
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        doc = json.loads(read_text(config))
    except ValueError as err:
        raise EdgeError(f"{config}: not valid JSON ({err})") from None
    template = doc.get("chat_template") if isinstance(doc, dict) else None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return None
    need(isinstance(template, str), f"{config}: chat_template: expected a string or a list of named templates")
    return template, f"{config}: chat_template"


def read_chat_template(path: Path) -> tuple[str, str]:
    """`--chat-template FILE`: a Jinja file, or a tokenizer_config.json holding one."""
    path = Path(path)
    need(path.is_file(), f"--chat-template {path}: file not found")
    if path.name == "tokenizer_config.json":
        found = find_chat_template(path.with_name("tokenizer.json"))
        need(found is not None, f"--chat-template {path}: has no chat_template")
        return found
    return read_text(path), str(path)


def check_chat_template(found: tuple[str, str], tokenizer: Tokenizer | None, cfg: ModelConfig) -> str:
    """The template text, once it has rendered a one-message conversation into tokens."""
    text, where = found
    need(isinstance(tokenizer, HFTokenizer), f"{where}: a chat template needs a tokenizer.json beside the model")
    template = ChatTemplate(text, where, tokenizer.token_text(cfg.bos_id), tokenizer.token_text(cfg.eos_id))
    ids = tokenizer.encode_template(template.render([{"role": "user", "content": "Hello"}]))
    need(len(ids) > 0, f"{where}: renders a conversation to no tokens")
    return text


def eos_ids(cfg: ModelConfig) -> tuple[int, ...]:
    """Every id that ends generation, the manifest's `eos_ids`: eos_id first, then the config's end_ids."""
    return () if cfg.eos_id is None else (cfg.eos_id, *cfg.end_ids)

