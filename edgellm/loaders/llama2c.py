"""llama2.c `.bin` checkpoints (float32): the legacy v0 layout and version 1 ("ak42" magic, 256-byte header).

v0 header: 7 int32 dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size (negative = unshared
classifier), seq_len. v1 header: uint32 magic 0x616b3432, int32 version, the same 7 int32 (vocab positive),
uint8 shared_classifier, zero padding to 256 bytes. Weights follow in the per-version order of `_ORDER`
(llama2.c export.py `legacy_export` / `version1_export`), each kind stacked over the layers. v0 also carries
the freq_cis tables [seq_len, head_size/2] (real, imag), which are skipped: RoPE is recomputed.

wq/wk are in Meta's interleaved-pair RoPE layout, so the config says rope_style="interleaved" and the
weights are used as they are. The file size is checked against the header before anything is allocated.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.errors import need

from .loaded import Loaded
from .tensors import materialize, meta_decoder

MAGIC = 0x616B3432  # "ak42" read as a little-endian uint32
V1_HEADER_BYTES = 256
FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")

# File order of the weight kinds per version; a trailing "*" means one tensor per layer, stacked.
_ORDER = {
    0: ("embed", "attn_norm*", "wq*", "wk*", "wv*", "wo*", "mlp_norm*", "w1*", "w2*", "w3*", "norm",
        "freq_real", "freq_imag", "classifier"),
    1: ("attn_norm*", "mlp_norm*", "norm", "embed", "wq*", "wk*", "wv*", "wo*", "w1*", "w2*", "w3*", "classifier"),
}


@dataclass(frozen=True)
class Header:
    version: int
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int  # always positive here; `shared` carries the classifier flag
    seq_len: int
    shared: bool
    weights_offset: int

    @property
    def hd(self) -> int:
        return self.dim // self.n_heads

    def numel(self, kind: str) -> int:
        """float32 count of one tensor of this kind (0 for the classifier when it is shared)."""
        d, f, kv = self.dim, self.hidden_dim, self.n_kv_heads * self.hd
        sizes = {"embed": self.vocab_size * d, "attn_norm": d, "mlp_norm": d, "norm": d, "wq": d * d,
                 "wk": kv * d, "wv": kv * d, "wo": d * d, "w1": f * d, "w2": d * f, "w3": f * d,
                 "freq_real": self.seq_len * self.hd // 2, "freq_imag": self.seq_len * self.hd // 2,
                 "classifier": 0 if self.shared else self.vocab_size * d}
        return sizes[kind]

    def file_bytes(self) -> int:
        count = sum(self.numel(k.rstrip("*")) * (self.n_layers if k.endswith("*") else 1)
                    for k in _ORDER[self.version])
        return self.weights_offset + 4 * count


def read_header(path: Path) -> Header:
    """Parse and validate the header, including the file size it implies (no weights read)."""
    need(sys.byteorder == "little", "llama2.c checkpoints are little-endian; this machine is not")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(V1_HEADER_BYTES)
    need(len(head) >= 28, f"{path}: {len(head)} bytes is too short for a llama2.c header (28 or 256 bytes)")
    if struct.unpack_from("<I", head)[0] == MAGIC:
        need(len(head) == V1_HEADER_BYTES, f"{path}: truncated llama2.c v1 header ({len(head)} of 256 bytes)")
        version = struct.unpack_from("<i", head, 4)[0]
        need(version == 1, f"{path}: llama2.c version {version} is not supported (expected 1, or a legacy v0 "
             f"file; version 2 is int8 Q8_0 - export the float32 v0/v1 file instead)")
        values = struct.unpack_from("<7i", head, 8)
        flag = head[36]
        need(flag in (0, 1), f"{path}: corrupt v1 header: shared_classifier byte is {flag} (expected 0 or 1)")
        need(values[5] > 0, f"{path}: corrupt v1 header: vocab_size {values[5]} (expected > 0)")
        shared, offset = bool(flag), V1_HEADER_BYTES
    else:
        version, values = 0, struct.unpack_from("<7i", head, 0)
        shared, offset = values[5] > 0, 28
    fields = dict(zip(FIELDS, values, strict=True))
    fields["vocab_size"] = abs(fields["vocab_size"])
    bad = [f"{k}={v}" for k, v in fields.items() if v <= 0]
    need(not bad, f"{path}: corrupt llama2.c header: {', '.join(bad)} (expected positive sizes)")
    need(fields["dim"] % fields["n_heads"] == 0 and (fields["dim"] // fields["n_heads"]) % 2 == 0,
         f"{path}: corrupt llama2.c header: dim {fields['dim']} / n_heads {fields['n_heads']} is not an even "
         f"head size")
    need(fields["n_heads"] % fields["n_kv_heads"] == 0,
         f"{path}: corrupt llama2.c header: n_heads {fields['n_heads']} is not a multiple of n_kv_heads "
         f"{fields['n_kv_heads']}")
    header = Header(version=version, shared=shared, weights_offset=offset, **fields)
    want = header.file_bytes()
    need(size == want, f"{path}: {size} bytes, but its llama2.c v{version} header "
         f"({', '.join(f'{k}={v}' for k, v in fields.items())}, {'shared' if shared else 'unshared'} classifier) "
         f"implies {want} bytes (truncated or corrupt)")
    return header


def header_config(h: Header) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        preset="llama2", vocab_size=h.vocab_size, dim=h.dim, n_layers=h.n_layers, n_heads=h.n_heads,
        n_kv_heads=h.n_kv_heads, hidden_dim=h.hidden_dim, max_seq_len=h.seq_len, norm_eps=1e-5,
        norm_eps_mode="add", rope_style="interleaved", rope_theta=10000.0, tie_embeddings=h.shared,
        bos_id=1, eos_id=2, extra={"source": "llama2c", "llama2c_version": h.version},
    ))


def _destination(model: Decoder, h: Header, kind: str, layer: int) -> torch.Tensor | None:
    """The (contiguous) slice of a model parameter this tensor fills; None for the skipped freq_cis tables."""
    q, kv, f = h.dim, h.n_kv_heads * h.hd, h.hidden_dim
    if kind == "embed":
        return model.embed.weight
    if kind == "norm":
        return model.norm.weight
    if kind == "classifier":
        return model.lm_head.weight
    if kind.startswith("freq"):
        return None
    block = model.layers[layer]
    return {
        "attn_norm": lambda: block.attn_norm.weight, "mlp_norm": lambda: block.mlp_norm.weight,
        "wq": lambda: block.attn.qkv.weight[:q], "wk": lambda: block.attn.qkv.weight[q:q + kv],
        "wv": lambda: block.attn.qkv.weight[q + kv:], "wo": lambda: block.attn.o.weight,
        "w1": lambda: block.mlp.gate_up.weight[:f], "w3": lambda: block.mlp.gate_up.weight[f:],
        "w2": lambda: block.mlp.down.weight,
    }[kind]()


def load_llama2c(path: Path) -> Loaded:
    path = Path(path)
    h = read_header(path)
    cfg = header_config(h)
    model = materialize(meta_decoder(cfg))  # uninitialised: every parameter is read from the file below
    with torch.no_grad(), open(path, "rb") as f:
        f.seek(h.weights_offset)
        for entry in _ORDER[h.version]:
            kind = entry.rstrip("*")
            if h.numel(kind) == 0:
                continue
            for layer in range(h.n_layers if entry.endswith("*") else 1):
                dest = _destination(model, h, kind, layer)
                if dest is None:
                    f.seek(4 * h.numel(kind), 1)
                    continue
                view = dest.detach().numpy()  # shares memory with the parameter; read straight into it
                need(view.size == h.numel(kind), f"{path}: internal size mismatch for {kind}")
                got = f.readinto(memoryview(view).cast("B"))
                need(got == view.nbytes, f"{path}: truncated while reading {kind} (layer {layer})")
    tokenizer = path.with_name("tokenizer.bin")  # run.c's default tokenizer, if it sits next to the model
    return Loaded(model.eval(), cfg, tokenizer if tokenizer.is_file() else None, "llama2c")
