"""`edgellm tokenizer train|encode|decode`: train a byte-level BPE, or look at what a tokenizer does."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import integer


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer; encode/decode with one",
                            description=__doc__)
    verbs = parser.add_subparsers(dest="action", metavar="ACTION")
    verbs.required = True

    train = verbs.add_parser("train", help="train a byte-level BPE on text files, write tokenizer.json")
    train.add_argument("corpus", nargs="+", type=Path, help="UTF-8 text files")
    train.add_argument("--vocab-size", type=integer, required=True, help="at most this many tokens (>= 259)")
    train.add_argument("-o", "--output", type=Path, default=Path("tokenizer.json"), help="tokenizer.json to write")

    encode = verbs.add_parser("encode", help="print the token ids of --text (no BOS)")
    encode.add_argument("tokenizer", type=Path, help="tokenizer.json or llama2.c tokenizer.bin")
    encode.add_argument("--text", required=True)

    decode = verbs.add_parser("decode", help="print the text of token ids")
    decode.add_argument("tokenizer", type=Path, help="tokenizer.json or llama2.c tokenizer.bin")
    decode.add_argument("ids", nargs="+", type=integer)

    for verb in (encode, decode):
        verb.add_argument("--vocab-size", type=integer, default=None,
                          help="the model's vocabulary size (required for a tokenizer.bin)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgellm.runtime.tokenizer import load_tokenizer

    if args.action == "train":
        from edgellm.train.bpe import train_bpe

        tok = train_bpe(args.corpus, args.vocab_size, args.output)
        print(f"wrote {args.output} ({tok.vocab_size} tokens)")
        return 0
    tok = load_tokenizer(args.tokenizer, args.vocab_size)
    if args.action == "encode":
        print(" ".join(str(i) for i in tok.encode(args.text)))
    else:
        print(tok.decode(args.ids))
    return 0
