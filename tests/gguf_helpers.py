"""Small GGUF files written in the tests the way llama.cpp's convert_hf_to_gguf.py writes them: a seeded
transformers model's weights under llama.cpp's names (llama Q/K rows permuted to interleaved RoPE order),
`{arch}.*` metadata, and a vocabulary trained here with the `tokenizers` library, either GPT-2-style
byte-level BPE ("gpt2": tokens + merges) or SentencePiece-style ("llama": tokens + scores + byte tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello world! Hello there, general Kenobi.",
    "def add(x, y):\n    return x + y\n", "Numbers 12345 and 3.14159 and 2026-11-25.",
    "Ünïcödé: café, naïve, 你好世界, こんにちは, 🙂 emoji.", "  leading spaces and\ttabs\n\nnewlines",
    "A chat: <|im_start|>user hi<|im_end|>", "tokenizers build vocabularies from text like this one",
] * 4
TEXTS = ["Hello world", "The quick brown fox", "  two leading spaces", "café 你好 🙂", "x = 12345 + 3.14\n\tdone",
         "unseen wordsmithery zq", "<|im_start|>user\nhi<|im_end|>", "<think>hmm</think> it's 2026", ""]

HF = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
      "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens (token_type 3)
USER_DEFINED = ["<think>"]  # token_type 4: matched whole in text, not special
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bpe_vocab(size: int = 300, pre: str = "smollm") -> dict[str, Any]:
    """Byte-level BPE (GPT-2 style): tokens in the byte alphabet, merges, three control tokens first, one
    user-defined token; `pre` names llama.cpp's pre-tokenizer ("smollm": GPT-2's regex, "qwen2": Qwen's)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS + USER_DEFINED, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    import json
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [3 if t in SPECIALS else 4 if t in USER_DEFINED else 1 for t in tokens]
    return dict(model="gpt2", pre=pre, tokens=tokens, merges=merges, types=types, bos=1, eos=2, add_bos=False)


def spm_vocab(size: int = 330) -> dict[str, Any]:
    """SentencePiece style (Llama 1/2): <unk> <s> </s>, the 256 byte tokens, then pieces with scores (no
    merges: readers derive them from the scores)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=size - 259, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = [p for p in pieces if p not in tokens]
    tokens += pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return dict(model="llama", tokens=tokens, scores=scores, types=types, bos=1, eos=2, add_bos=None)


def gemma_vocab(size: int = 330) -> dict[str, Any]:
    """Gemma style: pieces learned without a prefix space (add_space_prefix false), runs of spaces stored as
    spaces, no merges, and scores that do not follow the file order (readers must rank merges by position)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    trainer = trainers.BpeTrainer(vocab_size=size - 259, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    pieces = [t.replace("▁", " ") if set(t) == {"▁"} and len(t) > 1 else t
              for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<pad>", "<eos>", "<bos>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = [p for p in pieces if p not in tokens] + [s for s in ("  ", "   ") if s not in pieces]
    tokens += pieces
    scores = [0.0] * 259 + [float((i * 7919) % len(pieces)) for i in range(len(pieces))]
    types = [3, 3, 3] + [6] * 256 + [1] * len(pieces)
    return dict(model="llama", tokens=tokens, scores=scores, types=types, bos=2, eos=1, add_bos=True)


def hf_model(family: str, vocab: int, seed: int = 0, **over) -> torch.nn.Module:
    """A seeded transformers model with randomised norms/biases; GQA and sizes that quantize (rows % 32)."""
    fields = dict(vocab_size=vocab, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  max_position_embeddings=256)
    if family == "qwen3":
        fields.update(head_dim=128)  # transformers' GGUF reader leaves Qwen3 at its default head_dim, 128
    fields.update(over)
    config = getattr(transformers, HF[family][0])(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, HF[family][1])(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if name.endswith("bias") else 1.0))
    return model


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-half rows -> interleaved RoPE pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


# Gemma 3's four norms per layer (llama.cpp's names)
_GEMMA3 = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf: str, family: str = "llama") -> str:
    if hf in _NAMES:
        return _NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{(_GEMMA3 if family == 'gemma3' else _LAYER)[module]}.{kind}"


def k_quant_bytes(rows: int, cols: int, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small finite fp16 scales (gguf-py cannot quantize K types); other types
    get random bytes (only for files that must be refused)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
    if kind == Q.Q6_K:  # ql[128] qh[64] scales[16] d
        data[..., 208:210] = scale
    elif kind in (Q.Q4_K, Q.Q5_K):  # d, dmin, ...
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    return data.reshape(rows, cols // block * size)


def write_gguf(path: Path, model: torch.nn.Module, family: str, vocab: dict[str, Any], qtype: Q = Q.F32,
               meta: dict[str, Any] | None = None, drop: tuple[str, ...] = (), name: str = "test model",
               tensor_types: dict[str, Q] | None = None, seed: int = 0, arch: str | None = None) -> Path:
    """The model as llama.cpp would convert it: 2-D weights in `qtype` (K types as random blocks), 1-D in F32.
    `meta` overrides/adds metadata keys (`{arch}` is replaced), `drop` removes keys."""
    cfg = model.config
    arch = arch or family
    w = gguf.GGUFWriter(str(path), arch)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    keys: dict[str, Any] = {
        "general.name": name, "{arch}.context_length": cfg.max_position_embeddings,
        "{arch}.embedding_length": cfg.hidden_size, "{arch}.block_count": cfg.num_hidden_layers,
        "{arch}.feed_forward_length": cfg.intermediate_size, "{arch}.attention.head_count": cfg.num_attention_heads,
        "{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        "{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "{arch}.rope.freq_base": (cfg.rope_parameters.get("full_attention") or cfg.rope_parameters)["rope_theta"],
        "tokenizer.ggml.model": vocab["model"], "tokenizer.ggml.tokens": vocab["tokens"],
        "tokenizer.ggml.token_type": vocab["types"], "tokenizer.ggml.bos_token_id": vocab["bos"],
        "tokenizer.ggml.eos_token_id": vocab["eos"], "tokenizer.chat_template": TEMPLATE,
    }
    if family == "llama":
        keys["{arch}.rope.dimension_count"] = hd
    if family == "gemma3":
        keys["{arch}.attention.sliding_window"] = cfg.sliding_window
    if family in ("qwen3", "gemma3"):
        keys["{arch}.attention.key_length"] = hd
        keys["{arch}.attention.value_length"] = hd
    for key in ("pre", "merges", "scores"):
        if vocab.get(key) is not None:
            keys[f"tokenizer.ggml.{key}"] = vocab[key]
    if vocab.get("add_bos") is not None:
        keys["tokenizer.ggml.add_bos_token"] = vocab["add_bos"]
    keys.update(meta or {})
    for key, value in keys.items():
        key = key.replace("{arch}", arch)
        if key in drop or key == "general.architecture":
            continue
        _add(w, key, value)
    rng = np.random.default_rng(seed)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_name(hf, family)
        if name in drop:
            continue
        data = tensor.float().numpy()
        if family == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's Gemma converter stores the norm gain 1 + w
        if family == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = permute(data, cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads)
        kind = (tensor_types or {}).get(name, qtype if data.ndim == 2 else Q.F32)
        if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_NL):
            w.add_tensor(name, k_quant_bytes(*data.shape, kind, rng), raw_dtype=kind)
        elif kind == Q.F32:
            w.add_tensor(name, data)
        elif kind == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w, key: str, value: Any) -> None:
    T = gguf.GGUFValueType
    if isinstance(value, tuple):  # (value, GGUFValueType): a type of the test's choosing
        w.add_key_value(key, value[0], value[1])
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        sub = T.STRING if value and isinstance(value[0], str) else T.FLOAT32 if value and isinstance(
            value[0], float) else T.INT32
        w.add_array(key, value) if sub != T.FLOAT32 else w.add_key_value(key, value, T.ARRAY, sub_type=T.FLOAT32)
    else:
        raise TypeError(f"{key}: {value!r}")


def reference(path: Path) -> tuple[torch.nn.Module, Any]:
    """transformers' own GGUF load of the file (model fp32, tokenizer)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok
