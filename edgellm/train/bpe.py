"""Train a byte-level BPE tokenizer (the `tokenizers` library) and write it as `tokenizer.json`.

Ids 0, 1, 2 are `<pad>`, `<bos>`, `<eos>`; the 256 byte symbols follow, so every byte string has an
encoding and vocab_size must be at least 259. The file is HF's tokenizer.json, format version "1.0", with a
"<bos> $A" post-processor: edgellm trains every document as BOS ids EOS (train/data.py), so a prompt starts with
BOS, and the file says so to `transformers` and to export's rule (export/bos_rule.py).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.tokenizer import HFTokenizer

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
MIN_VOCAB = len(SPECIAL_TOKENS) + 256


def train_bpe_from_iterator(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train in memory; the vocabulary may come out smaller than `vocab_size` on a small corpus."""
    need(vocab_size >= MIN_VOCAB, f"--vocab-size {vocab_size}: must be at least {MIN_VOCAB} (3 specials + 256 bytes)")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: decode(encode(text)) must give back text, not " " + text
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen in the corpus or not
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for want, name in enumerate(SPECIAL_TOKENS):
        need(tok.token_to_id(name) == want, f"BPE training put {name} at id {tok.token_to_id(name)}, not {want}")
    bos = SPECIAL_TOKENS[1]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, 1)])
    return HFTokenizer(tok, "<trained in memory>", bos_id=1, eos_id=2, pad_id=0)


def train_bpe(files: list[Path], vocab_size: int, out: Path) -> HFTokenizer:
    """Train on text files (UTF-8; undecodable bytes become U+FFFD) and write `out` atomically."""
    need(len(files) > 0, "no corpus files given")
    for path in files:
        need(Path(path).is_file(), f"{path}: corpus file not found")
    tok = train_bpe_from_iterator(_lines(files), vocab_size)
    out = Path(out)
    write_atomic(out, tok.tok.to_str(pretty=True))
    tok.source = str(out)
    return tok


def _lines(files: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace", newline="") as fh:
                yield from fh  # lines keep their "\n", so newline merges are learned too
        except OSError as exc:
            raise EdgeError(f"{path}: cannot read corpus file ({exc.strerror})") from None


def write_atomic(out: Path, text: str) -> None:
    """Write to a temp file beside `out`, then rename: a reader never sees half a file."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:
        raise EdgeError(f"{out}: cannot write ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
