"""llama2.c `.bin` loading (v0 and v1, shared and unshared classifier) against an independent numpy forward
written here the way run.c computes (token by token, RoPE on (x0,x1),(x2,x3)... pairs as complex numbers),
the real stories260K weights, and corrupt files."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.cli import main
from edgellm.loaders import load_checkpoint
from edgellm.runtime.errors import EdgeError

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K.bin"  # shared/ beside the repo
STORIES_SHA256 = "9414d5a285453a7eab631713d171753232c978f6f97654211469aff8be93c8d6"
# First 20 greedy tokens after BOS from stories260K, computed once with the numpy forward below and pasted in.
STORIES_GREEDY_20 = [461, 461, 401, 401, 401, 461, 378, 455, 473, 456, 435, 299, 362, 409, 283, 264, 283, 452, 288, 13]

SIZES = dict(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, seq_len=24)
LAYER_KINDS = ("rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3")


# ---- writing .bin files the way llama2.c's export.py lays them out ----

def random_weights(shared: bool, seed: int) -> dict[str, np.ndarray]:
    """llama2.c tensors (float32, [out, in]) with random norms too, so a mix-up cannot go unnoticed."""
    rng = np.random.default_rng(seed)
    d, f, n, v = SIZES["dim"], SIZES["hidden_dim"], SIZES["n_layers"], SIZES["vocab_size"]
    kv = SIZES["n_kv_heads"] * d // SIZES["n_heads"]
    shapes = dict(emb=(v, d), rms_att=(n, d), wq=(n, d, d), wk=(n, kv, d), wv=(n, kv, d), wo=(n, d, d),
                  rms_ffn=(n, d), w1=(n, f, d), w2=(n, d, f), w3=(n, f, d), rms_final=(d,), wcls=(v, d))
    w = {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in shapes.items()}
    for k in ("rms_att", "rms_ffn", "rms_final"):
        w[k] = (1.0 + w[k]).astype(np.float32)
    if shared:
        w["wcls"] = w["emb"]
    return w


def write_v0(path: Path, w: dict[str, np.ndarray], shared: bool) -> None:
    s = SIZES
    vocab = s["vocab_size"] if shared else -s["vocab_size"]
    hd = s["dim"] // s["n_heads"]
    angles = np.arange(s["seq_len"])[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", s["dim"], s["hidden_dim"], s["n_layers"], s["n_heads"], s["n_kv_heads"], vocab,
                            s["seq_len"]))
        for k in ("emb", *LAYER_KINDS, "rms_final"):
            f.write(w[k].tobytes())
        f.write(np.cos(angles).astype(np.float32).tobytes())
        f.write(np.sin(angles).astype(np.float32).tobytes())
        if not shared:
            f.write(w["wcls"].tobytes())


def write_v1(path: Path, w: dict[str, np.ndarray], shared: bool, version: int = 1) -> None:
    s = SIZES
    header = struct.pack("<Ii7iB", 0x616B3432, version, s["dim"], s["hidden_dim"], s["n_layers"], s["n_heads"],
                         s["n_kv_heads"], s["vocab_size"], s["seq_len"], int(shared))
    with open(path, "wb") as f:
        f.write(header + b"\0" * (256 - len(header)))
        for k in ("rms_att", "rms_ffn", "rms_final", "emb", "wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            f.write(w[k].tobytes())
        if not shared:
            f.write(w["wcls"].tobytes())


def read_v0(path: Path) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A second, independent reader of the legacy layout (for the real stories260K file)."""
    data = path.read_bytes()
    dim, hidden, n, heads, kv_heads, vocab, seq = struct.unpack_from("<7i", data)
    hd, kv = dim // heads, kv_heads * dim // heads
    flat = np.frombuffer(data, dtype="<f4", offset=28)
    shapes = [("emb", (abs(vocab), dim)), ("rms_att", (n, dim)), ("wq", (n, dim, dim)), ("wk", (n, kv, dim)),
              ("wv", (n, kv, dim)), ("wo", (n, dim, dim)), ("rms_ffn", (n, dim)), ("w1", (n, hidden, dim)),
              ("w2", (n, dim, hidden)), ("w3", (n, hidden, dim)), ("rms_final", (dim,)),
              ("freq_real", (seq, hd // 2)), ("freq_imag", (seq, hd // 2))]
    w, at = {}, 0
    for name, shape in shapes:
        size = int(np.prod(shape))
        w[name], at = flat[at:at + size].reshape(shape), at + size
    w["wcls"] = w["emb"] if vocab > 0 else flat[at:].reshape(abs(vocab), dim)
    sizes = dict(dim=dim, n_layers=n, n_heads=heads, n_kv_heads=kv_heads, vocab_size=abs(vocab), seq_len=seq)
    return w, sizes


# ---- the independent forward: run.c's computation, one token at a time with a kv cache ----

class NumpyLlama2c:
    def __init__(self, w: dict[str, np.ndarray], sizes: dict[str, int]) -> None:
        self.w = {k: v.astype(np.float64) for k, v in w.items()}
        self.s = sizes
        self.hd = sizes["dim"] // sizes["n_heads"]
        self.keys: list[list[np.ndarray]] = [[] for _ in range(sizes["n_layers"])]
        self.values: list[list[np.ndarray]] = [[] for _ in range(sizes["n_layers"])]

    @staticmethod
    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return g * (x / np.sqrt(np.mean(x * x) + 1e-5))

    def rope(self, vec: np.ndarray, pos: int) -> np.ndarray:
        """Rotate each head's pairs (x0,x1),(x2,x3)... as complex numbers by pos * 10000^(-2i/hd)."""
        pairs = vec.reshape(-1, self.hd // 2, 2)
        z = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * pos * 10000.0 ** (-np.arange(0, self.hd, 2) / self.hd))
        return np.stack([z.real, z.imag], axis=-1).reshape(-1)

    def step(self, token: int, pos: int) -> np.ndarray:
        w, hd = self.w, self.hd
        group = self.s["n_heads"] // self.s["n_kv_heads"]
        x = w["emb"][token].copy()
        for layer in range(self.s["n_layers"]):
            xb = self.rms(x, w["rms_att"][layer])
            q = self.rope(w["wq"][layer] @ xb, pos)
            self.keys[layer].append(self.rope(w["wk"][layer] @ xb, pos))
            self.values[layer].append(w["wv"][layer] @ xb)
            keys, values = np.array(self.keys[layer]), np.array(self.values[layer])  # [pos+1, kv*hd]
            out = np.zeros_like(q)
            for h in range(self.s["n_heads"]):
                g = h // group  # run.c: key_cache + (h / kv_mul) * head_size
                scores = keys[:, g * hd:(g + 1) * hd] @ q[h * hd:(h + 1) * hd] / np.sqrt(hd)
                p = np.exp(scores - scores.max())
                out[h * hd:(h + 1) * hd] = (p / p.sum()) @ values[:, g * hd:(g + 1) * hd]
            x = x + w["wo"][layer] @ out
            xb = self.rms(x, w["rms_ffn"][layer])
            a, b = w["w1"][layer] @ xb, w["w3"][layer] @ xb
            x = x + w["w2"][layer] @ (a / (1.0 + np.exp(-a)) * b)
        return w["wcls"] @ self.rms(x, w["rms_final"])


def numpy_logits(w: dict[str, np.ndarray], sizes: dict[str, int], tokens: list[int]) -> np.ndarray:
    ref = NumpyLlama2c(w, sizes)
    return np.array([ref.step(t, pos) for pos, t in enumerate(tokens)])


def edgellm_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0][0].double().numpy()


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("version", [0, 1])
def test_bin_matches_run_c_forward(tmp_path, version, shared):
    w = random_weights(shared, seed=10 * version + shared)
    path = tmp_path / "model.bin"
    (write_v0 if version == 0 else write_v1)(path, w, shared)
    loaded = load_checkpoint(path)
    cfg = loaded.config
    assert loaded.source == "llama2c" and cfg.preset == "llama2" and cfg.rope_style == "interleaved"
    assert cfg.tie_embeddings == shared and (cfg.bos_id, cfg.eos_id) == (1, 2) and not loaded.model.training
    assert (cfg.dim, cfg.n_kv_heads, cfg.vocab_size, cfg.max_seq_len) == (32, 2, 96, 24)
    tokens = [1, 5, 17, 90, 3, 44, 44, 60, 2, 71, 8, 30]
    diff = np.abs(edgellm_logits(loaded.model, tokens) - numpy_logits(w, SIZES, tokens)).max()
    assert diff <= 1e-4, diff
    assert loaded.tokenizer_path is None
    (tmp_path / "tokenizer.bin").write_bytes(b"")  # run.c's default tokenizer name, next to the model
    assert load_checkpoint(path).tokenizer_path == tmp_path / "tokenizer.bin"


def greedy_both(model, w: dict[str, np.ndarray], sizes: dict[str, int], prompt: list[int],
                n: int) -> tuple[list[int], list[int]]:
    """`n` greedy tokens after `prompt` from edgellm's model and from the numpy run.c forward."""
    ref = NumpyLlama2c(w, sizes)
    logits = [ref.step(t, pos) for pos, t in enumerate(prompt)][-1]
    ours, theirs = list(prompt), []
    with torch.no_grad():
        for pos in range(len(prompt), len(prompt) + n):
            ours.append(int(model(torch.tensor([ours]))[0][0, -1].argmax()))
            theirs.append(int(np.argmax(logits)))
            logits = ref.step(theirs[-1], pos)
    return ours[len(prompt):], theirs


def test_stories260k_greedy_matches_numpy_and_golden(capsys):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} not present")
    assert hashlib.sha256(STORIES.read_bytes()).hexdigest() == STORIES_SHA256
    loaded = load_checkpoint(STORIES)
    cfg = loaded.config
    assert (cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.max_seq_len) == \
        (64, 172, 5, 8, 4, 512, 512) and cfg.tie_embeddings

    w, sizes = read_v0(STORIES)
    # the file's own freq_cis tables are llama2.c's RoPE: the layout we read is the one it was written in
    angles = np.arange(512)[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    assert np.abs(w["freq_real"] - np.cos(angles)).max() < 1e-5 and np.abs(w["freq_imag"] - np.sin(angles)).max() < 1e-5

    ours, ref = greedy_both(loaded.model, w, sizes, [1], 40)
    assert ours == ref and ours[:20] == STORIES_GREEDY_20

    assert main(["info", str(STORIES)]) == 0
    out = capsys.readouterr().out
    assert "source: llama2c" in out and "parameters: 260032" in out and "rope_style: interleaved" in out


def _bad(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    return path


def test_corrupt_and_truncated_files(tmp_path):
    w = random_weights(True, seed=3)
    good = tmp_path / "good.bin"
    write_v0(good, w, True)
    data = good.read_bytes()
    cases = {
        "truncated": data[:-4],
        "trailing bytes": data + b"\0" * 4,
        "tiny": data[:10],
        "huge dim": struct.pack("<7i", 1 << 30, 48, 2, 4, 2, 96, 24) + data[28:],  # must not allocate 4 GB
        "zero layers": struct.pack("<7i", 32, 48, 0, 4, 2, 96, 24) + data[28:],
        "bad kv heads": struct.pack("<7i", 32, 48, 2, 4, 3, 96, 24) + data[28:],
    }
    for case, blob in cases.items():
        path = _bad(tmp_path, blob)
        with pytest.raises(EdgeError, match="bad.bin") as err:
            load_checkpoint(path)
        assert "llama2.c" in str(err.value) or "bytes" in str(err.value), case

    v1 = tmp_path / "v2.bin"
    write_v1(v1, w, True, version=2)
    with pytest.raises(EdgeError, match="version 2 is not supported"):
        load_checkpoint(v1)
    write_v1(v1, w, True)
    blob = bytearray(v1.read_bytes())
    blob[36] = 7  # shared_classifier flag
    with pytest.raises(EdgeError, match="shared_classifier"):
        load_checkpoint(_bad(tmp_path, bytes(blob)))
