"""Tokenizers: byte-level BPE round trips, llama2.c tokenizer.bin against a transliteration of run.c,
streaming decode, corrupt files, and the `edgellm tokenizer` verb."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from edgellm.cli import main
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.tokenizer import (
    BYTE_TO_UNICODE,
    HFTokenizer,
    IncrementalDecoder,
    Llama2cTokenizer,
    load_tokenizer,
)
from edgellm.train.bpe import train_bpe, train_bpe_from_iterator

SAMPLES = ["the cat", "hello world", "你好世界", "naïve café", "🙂🚀👍", "zebra\n", "  tabs\tand spaces", "ёжик"]


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(SAMPLES) for _ in range(rng.randint(1, 6))) for _ in range(n)]


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_bpe_from_iterator(corpus(), vocab_size=320)


def stream(tok, ids: list[int]) -> list[str]:
    dec = IncrementalDecoder(tok)
    return [dec.push(i) for i in ids] + [dec.flush()]


# ---------------------------------------------------------------------------------- byte-level BPE


def test_trained_layout(bpe: HFTokenizer) -> None:
    assert (bpe.pad_id, bpe.bos_id, bpe.eos_id) == (0, 1, 2)
    assert bpe.byte_exact and 259 < bpe.vocab_size <= 320
    assert len(bpe.encode("hello world")) < len("hello world")  # merges were learned
    assert bpe.token_bytes(1) == b"" and bpe.decode([1, *bpe.encode("the cat"), 2]) == "the cat"
    assert sorted(BYTE_TO_UNICODE.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_bpe_text_round_trip(bpe: HFTokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert bpe.tok.decode(ids) == text  # the Rust ByteLevel decoder agrees
    assert b"".join(bpe.token_bytes(i) for i in ids) == text.encode("utf-8")


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=40))
def test_bpe_raw_bytes_round_trip(bpe: HFTokenizer, data: bytes) -> None:
    ids = bpe.encode(data.decode("utf-8", "surrogateescape"))
    assert b"".join(bpe.token_bytes(i) for i in ids) == data
    assert bpe.decode(ids) == data.decode("utf-8", "replace")
    assert "".join(stream(bpe, ids)) == bpe.decode(ids)


def test_bpe_stream_never_splits_a_character(bpe: HFTokenizer) -> None:
    text = "🙂 你好 🦀 ꙮ 𝄞 naïve"  # 🦀, ꙮ and 𝄞 never occur in the corpus: split into single bytes
    ids = bpe.encode(text)
    partial = [i for i in ids if not _is_utf8(bpe.token_bytes(i))]
    assert len(partial) >= 3  # the test only means something if characters are cut across tokens
    pieces = stream(bpe, ids)
    assert "".join(pieces) == text == bpe.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" and bpe.token_bytes(i) for i, p in zip(ids, pieces, strict=False))  # bytes held back


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_llama_style_hf_stream_uses_prefix_decoding() -> None:
    """A sentencepiece-style tokenizer.json (Metaspace, byte fallback, Strip): not byte-exact."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "h", "i", "▁h", "hi", "▁hi"]:
        vocab[piece] = len(vocab)
    rust = RustTokenizer(models.BPE(vocab, [("▁", "h"), ("h", "i"), ("▁h", "i")], byte_fallback=True, unk_token="<unk>"))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    rust.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok = HFTokenizer(rust, "llama-style")
    assert (tok.bos_id, tok.eos_id, tok.byte_exact) == (1, 2, False)
    text = "hi 你🙂 hi hi"
    ids = tok.encode(text)
    assert ids[0] == vocab["▁hi"] and 3 + 0xF0 in ids  # merged piece first, emoji as byte pieces
    pieces = stream(tok, ids)
    assert "".join(pieces) == text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


# ---------------------------------------------------------------------------------- llama2.c


SPECIALS = [b"<unk>", b"\n<s>\n", b"\n</s>\n"]
# (piece, score): every merged piece is the concatenation of two pieces; equal scores test the leftmost rule
MERGED = [(" ", -1.0), ("t", -2.0), ("h", -3.0), ("e", -4.0), ("a", -5.0), ("l", -6.0), ("o", -7.0),
          ("th", -10.0), ("he", -10.0), ("the", -12.0), (" t", -11.0), (" the", -13.0), ("aa", -20.0),
          ("aaa", -20.0), ("ll", -15.0), ("el", -15.0), ("hel", -16.5), ("hell", -16.0), ("lo", -17.0),
          ("hello", -18.0), (" hello", -19.0), ("你", -8.0), ("好", -9.0), ("你好", -14.0), ("é", -30.0),
          ("🚀", -31.0)]


def llama2c_vocab() -> tuple[list[bytes], list[float]]:
    pieces = SPECIALS + [b"<0x%02X>" % b for b in range(256)] + [p.encode() for p, _ in MERGED]
    scores = [0.0] * (3 + 256) + [s for _, s in MERGED]
    return pieces, scores


def write_bin(path: Path, pieces: list[bytes], scores: list[float]) -> Path:
    body = b"".join(struct.pack("<fi", s, len(p)) + p for p, s in zip(pieces, scores, strict=True))
    path.write_bytes(struct.pack("<i", max(map(len, pieces))) + body)
    return path


@pytest.fixture(scope="module")
def l2c(tmp_path_factory: pytest.TempPathFactory) -> Llama2cTokenizer:
    pieces, scores = llama2c_vocab()
    path = write_bin(tmp_path_factory.mktemp("l2c") / "tokenizer.bin", pieces, scores)
    tok = load_tokenizer(path, vocab_size=len(pieces))
    assert isinstance(tok, Llama2cTokenizer)
    return tok


def ref_encode(data: bytes, pieces: list[bytes], scores: list[float]) -> list[int]:
    """run.c's encode, statement by statement: dummy prefix, codepoints or <0xNN>, greedy best-score merges."""
    lookup: dict[bytes, int] = {}
    for i, p in enumerate(pieces):
        lookup.setdefault(p, i)
    tokens = [lookup[b" "]] if data else []
    buf = b""
    for k, c in enumerate(data):
        if (c & 0xC0) != 0x80:
            buf = b""
        buf += bytes([c])
        nxt = data[k + 1] if k + 1 < len(data) else 0
        if (nxt & 0xC0) == 0x80 and len(buf) < 4:
            continue
        tokens += [lookup[buf]] if buf in lookup else [b + 3 for b in buf]
        buf = b""
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            merged = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]], -1)
            if merged != -1 and scores[merged] > best_score:
                best_score, best_id, best_idx = scores[merged], merged, i
        if best_idx == -1:
            return tokens
        tokens[best_idx : best_idx + 2] = [best_id]


def ref_decode(prev: int, token: int, pieces: list[bytes]) -> bytes:
    piece = pieces[token]
    if prev == 1 and piece.startswith(b" "):
        piece = piece[1:]
    if piece.startswith(b"<0x") and len(piece) == 6:
        return bytes([int(piece[3:5], 16)])
    return piece


def test_llama2c_known_encodings(l2c: Llama2cTokenizer) -> None:
    ids = {p: 259 + i for i, (p, _) in enumerate(MERGED)}
    assert l2c.encode("the") == [ids[" the"]]
    assert l2c.encode("hello 你好") == [ids[" hello"], ids[" "], ids["你好"]]
    assert l2c.encode("aaa") == [ids[" "], ids["aaa"]]
    # tied scores: the leftmost pair merges first, so "aaaa" -> " " "aa" "a" "a" -> " " "aaa" "a"
    assert l2c.encode("aaaa") == [ids[" "], ids["aaa"], ids["a"]]
    assert l2c.encode("z🙂") == [ids[" "], 0x7A + 3, 0xF0 + 3, 0x9F + 3, 0x99 + 3, 0x82 + 3]
    assert l2c.encode("") == []
    # run.c reads at most 4 bytes per codepoint: a stray continuation byte after 🚀 starts a new group
    rocket_stray = b"\xf0\x9f\x9a\x80\x80".decode("utf-8", "surrogateescape")
    assert l2c.encode(rocket_stray) == [ids[" "], ids["🚀"], 0x80 + 3]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("thelao 你好é🙂z\n")) | st.characters(codec="utf-8"), max_size=40))
def test_llama2c_matches_run_c(l2c: Llama2cTokenizer, text: str) -> None:
    ids = l2c.encode(text)
    assert ids == ref_encode(text.encode("utf-8"), l2c.pieces, l2c.scores)
    seq = [1, *ids]  # run.c feeds BOS first, then decodes each token given the one before it
    assert b"".join(ref_decode(p, t, l2c.pieces) for p, t in zip(seq, seq[1:], strict=False)) == text.encode()
    assert l2c.decode(ids) == l2c.decode([1, *ids]) == text
    assert "".join(stream(l2c, ids)) == text


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=30))
def test_llama2c_raw_bytes(l2c: Llama2cTokenizer, data: bytes) -> None:
    ids = l2c.encode(data.decode("utf-8", "surrogateescape"))
    assert ids == ref_encode(data, l2c.pieces, l2c.scores)
    assert b"".join(l2c.piece_bytes(t, p) for p, t in zip([None, *ids], ids, strict=False)) == data
    assert "".join(stream(l2c, ids)) == l2c.decode(ids) == data.decode("utf-8", "replace")


def test_llama2c_stream_emoji_split_over_byte_tokens(l2c: Llama2cTokenizer) -> None:
    ids = l2c.encode("你🙂好")
    pieces = stream(l2c, ids)
    assert [p for p in pieces if p] == ["你", "🙂", "好"] and len(ids) > 3


# ---------------------------------------------------------------------------------- bad files


def test_llama2c_corrupt_files(tmp_path: Path) -> None:
    pieces, scores = llama2c_vocab()
    good = write_bin(tmp_path / "good.bin", pieces, scores).read_bytes()
    cases = {f"cut{n}": good[:n] for n in (0, 3, 4, 10, 600, len(good) - 1)}
    cases["trailing"] = good + b"\0"
    cases["negative_len"] = good[:4] + struct.pack("<fi", 0.0, -5) + good[12:]
    cases["too_long"] = good[:4] + struct.pack("<fi", 0.0, 10_000) + good[12:]
    cases["bad_header"] = struct.pack("<i", 0) + good[4:]
    for name, data in cases.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        with pytest.raises(EdgeError, match=name) as err:
            load_tokenizer(path, vocab_size=len(pieces))
        assert "\n" not in str(err.value)
    no_bytes = write_bin(tmp_path / "nobytes.bin", SPECIALS + [b"x"] * 256, [0.0] * 259)
    with pytest.raises(EdgeError, match="byte pieces"):
        load_tokenizer(no_bytes, vocab_size=259)
    with pytest.raises(EdgeError, match="truncated"):  # the model claims more tokens than the file holds
        load_tokenizer(tmp_path / "good.bin", vocab_size=len(pieces) + 1)
    with pytest.raises(EdgeError, match=r"needs the model's vocab size \(`vocab_size`\)"):
        load_tokenizer(tmp_path / "good.bin")


def test_the_kind_not_the_file_name_decides(tmp_path: Path, l2c: Llama2cTokenizer) -> None:
    """An export's manifest records `tokenizer.kind`, and the loader reads that, whatever the file is called;
    only a file a user names is known by its suffix."""
    pieces, scores = llama2c_vocab()
    odd = write_bin(tmp_path / "vocab.model", pieces, scores)
    assert load_tokenizer(odd, len(pieces), kind="llama2c").encode("hello world") == l2c.encode("hello world")
    with pytest.raises(EdgeError, match="unknown tokenizer file"):
        load_tokenizer(odd, len(pieces))
    with pytest.raises(EdgeError, match="unknown tokenizer kind 'sentencepiece'"):
        load_tokenizer(odd, len(pieces), kind="sentencepiece")  # type: ignore[arg-type]


@pytest.mark.parametrize(("content", "why"), [
    (b"{not json", "not UTF-8 JSON"), (b"\xff\xfe\x00", "not UTF-8 JSON"), (b"[]", "no 'model' section"),
    (b'{"version": "9.9", "model": {}}', "version '9.9' is not supported"),
    (b'{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}', "corrupt tokenizer.json"),
    (b'{"version": "1.0", "model": {"type": "Nope"}}', "corrupt tokenizer.json"),
])
def test_corrupt_tokenizer_json(tmp_path: Path, content: bytes, why: str) -> None:
    """The Rust parser refuses these; the error then says what is wrong (tokenizer_hf._read_hf)."""
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(EdgeError, match=why) as err:
        load_tokenizer(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_packed_tokenizer_json_reads_as_the_plain_one(tmp_path: Path, bpe: HFTokenizer) -> None:
    """Exports ship tokenizer.json.xz (format 11): the same ids and text as the tokenizer.json it packs;
    copy_tokenizer packs and unpacks by the names; bad xz data is a one-line error naming the file."""
    import lzma

    from edgellm.runtime.tokenizer import copy_tokenizer, tokenizer_kind

    plain = tmp_path / "tokenizer.json"
    bpe.tok.save(str(plain))
    copy_tokenizer(plain, tmp_path / "tokenizer.json.xz", "hf")
    copy_tokenizer(tmp_path / "tokenizer.json.xz", tmp_path / "again.json", "hf")  # a 10's name from an 11's file
    assert lzma.decompress((tmp_path / "tokenizer.json.xz").read_bytes()) == (tmp_path / "again.json").read_bytes()
    packed = load_tokenizer(tmp_path / "tokenizer.json.xz", 320)
    text = " ".join(corpus(20, seed=3))
    assert packed.encode(text) == bpe.encode(text) and packed.decode(bpe.encode(text)) == text
    assert tokenizer_kind(tmp_path / "tokenizer.json.xz") == "hf"
    (tmp_path / "bad.json.xz").write_bytes(b"{not xz")
    with pytest.raises(EdgeError, match="corrupt tokenizer.json.xz") as err:
        load_tokenizer(tmp_path / "bad.json.xz")
    assert "\n" not in str(err.value) and "bad.json.xz" in str(err.value)
    with pytest.raises(EdgeError, match="unknown tokenizer file"):
        tokenizer_kind(tmp_path / "tokenizer.bin.xz")


def test_missing_and_unknown_files(tmp_path: Path) -> None:
    with pytest.raises(EdgeError, match="not found"):
        load_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "vocab.txt").write_text("a")
    with pytest.raises(EdgeError, match="unknown tokenizer file"):
        load_tokenizer(tmp_path / "vocab.txt")


# ---------------------------------------------------------------------------------- training + CLI


def test_train_bpe_file_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(corpus(200, seed=1)), encoding="utf-8")
    out = tmp_path / "sub" / "tokenizer.json"
    assert main(["tokenizer", "train", str(text), "--vocab-size", "300", "-o", str(out)]) == 0
    assert [p.name for p in out.parent.iterdir()] == ["tokenizer.json"]  # no temp file left behind
    tok = load_tokenizer(out)
    direct = train_bpe([text], 300, tmp_path / "again.json")
    assert tok.encode("hello world 你好") == direct.encode("hello world 你好")  # training is deterministic
    capsys.readouterr()

    assert main(["tokenizer", "encode", str(out), "--text", "hello 🙂"]) == 0
    ids = [int(i) for i in capsys.readouterr().out.split()]
    assert ids == tok.encode("hello 🙂")
    assert main(["tokenizer", "decode", str(out), "1", *map(str, ids), "2"]) == 0
    assert capsys.readouterr().out == "hello 🙂\n"

    assert main(["tokenizer", "train", str(tmp_path / "missing.txt"), "--vocab-size", "300"]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert main(["tokenizer", "train", str(text), "--vocab-size", "100", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--vocab-size" in err and err.count("\n") == 1
    assert main(["tokenizer", "decode", str(out), "99999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
