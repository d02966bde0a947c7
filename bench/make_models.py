"""Random-weight Hugging Face checkpoints with the anchor shapes (docs: research/anchors-perf.md).

    python bench/make_models.py [OUT=/tmp/edgellm-bench/hf] [--only s15m,s110m,q05b]

Speed does not depend on the weight values, so these stand in for stories15M / stories110M /
Qwen2.5-0.5B (no network needed). Weights are seeded (0) and saved fp32 with `save_pretrained`; build
them in a scratch directory, never in the repository (q05b is ~2 GB).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SHAPES = {
    # name: (family, hidden, layers, heads, kv heads, ffn, vocab, tied, rope theta, max positions)
    "s15m": ("llama", 288, 6, 6, 6, 768, 32000, False, 10000.0, 256),
    "s110m": ("llama", 768, 12, 12, 12, 2048, 32000, False, 10000.0, 1024),
    "q05b": ("qwen2", 896, 24, 14, 2, 4864, 151936, True, 1_000_000.0, 2048),
}


def build(name: str, out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    family, dim, layers, heads, kv, ffn, vocab, tied, theta, max_pos = SHAPES[name]
    common = dict(hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                  intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=tied, rope_theta=theta,
                  max_position_embeddings=max_pos, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(rms_norm_eps=1e-5, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(rms_norm_eps=1e-6, **common))
    target = out / name
    model.eval().save_pretrained(target, safe_serialization=True)
    write_tokenizer(target, vocab)
    return target


def write_tokenizer(target: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json filling the vocabulary (onnxruntime-genai's builder needs one):
    <unk> <s> </s>, the 256 byte symbols, then filler tokens; no merges. Timing uses token ids anyway."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *byte_symbols])}
    vocab.update({f"<filler_{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(target / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 1 << 20}
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, default=Path("/tmp/edgellm-bench/hf"))
    parser.add_argument("--only", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    args = parser.parse_args()
    for name in args.only.split(","):
        if (args.out / name / "tokenizer.json").is_file():
            print(f"{name}: exists in {args.out / name}")
            continue
        start = time.perf_counter()
        path = build(name, args.out)
        print(f"{name}: wrote {path} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
