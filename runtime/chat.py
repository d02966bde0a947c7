"""Chat templates: a conversation (a list of {"role", "content"} messages) -> the prompt text a chat model was
trained on, rendered from the model's own Jinja template (`tokenizer_config.json`'s `chat_template`, which
export copies to `chat_template.jinja`).

Rendered as Hugging Face `transformers` renders it (`apply_chat_template`; tests/test_chat.py compares the
two): a sandboxed environment that cannot touch Python objects, `trim_blocks` and `lstrip_blocks`, `{% break %}`
/ `{% continue %}`, `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` that keeps non-ASCII text as is, and
`{% generation %}` blocks rendered as plain text. The template's special tokens (`<|im_start|>`, ...) are
tokenized as control tokens (`HFTokenizer.encode_template`) and it places BOS itself, so none is added.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from .errors import EdgeError, need
from .tokenizer_common import one_line, read_file

ROLES = ("system", "user", "assistant", "tool")
_MAX_TEMPLATE_BYTES = 1 << 20


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise EdgeError("chat templates need jinja2 (pip install jinja2)") from None
    return jinja2


def _raise(message: str) -> None:
    raise EdgeError(f"chat template: {message}")


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment():
    jinja2 = _jinja()

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template, with the special-token strings it may refer to."""

    def __init__(self, source: str, where: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source, self.where = source, where
        self.bos_token, self.eos_token = bos_token, eos_token
        jinja2 = _jinja()
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as err:
            raise EdgeError(f"{where}: not a valid Jinja chat template ({one_line(err)})") from None

    @classmethod
    def from_file(cls, path: Path, bos_token: str | None = None, eos_token: str | None = None) -> ChatTemplate:
        return cls(read_text(path), str(path), bos_token, eos_token)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending with the assistant's opening if `add_generation_prompt`."""
        check_messages(messages)
        jinja2 = _jinja()
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except EdgeError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise EdgeError(f"{self.where}: rendering failed ({one_line(err)})") from None


def read_text(path: Path) -> str:
    """A template file (or the tokenizer_config.json holding one) as text: at most 1 MiB of UTF-8."""
    raw = read_file(path)
    need(len(raw) <= _MAX_TEMPLATE_BYTES, f"{path}: larger than {_MAX_TEMPLATE_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise EdgeError(f"{path}: not UTF-8 text") from None


def check_messages(messages: Sequence[dict]) -> None:
    need(isinstance(messages, (list, tuple)) and len(messages) > 0, "chat: expected a non-empty list of messages")
    for i, m in enumerate(messages):
        need(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str),
             f"chat: messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r}"[:200])
        need(m["role"] in ROLES, f"chat: messages[{i}].role: expected one of {', '.join(ROLES)}, got {m['role']!r}")
