"""The PyTorch side of a diff: the reference pass, greedy continuations, and generated evaluation text.

The model runs the way the export does: chunked prefill of `prefill_chunk` tokens through a runtime
`KVCache` (the PyTorch layers read the numpy buffers through `torch.from_numpy`, so both sides follow the
one cache rule), layer by layer so every hidden state and K/V row is observable.
The caller builds the model for the export's context first (`model.set_context_len(max_seq)`).
"""

from __future__ import annotations

import numpy as np
import torch

from edgellm.model import Decoder
from edgellm.runtime.errors import need
from edgellm.runtime.graphio import cache_rows
from edgellm.runtime.kvcache import KVCache, plan_calls

from .trace import Trace, join_rows


def new_cache(model: Decoder, max_seq: int) -> KVCache:
    cfg = model.cfg
    return KVCache(cfg.n_layers, cfg.n_kv_heads, max_seq, cfg.hd, rows=cache_rows(cfg.to_dict(), max_seq))


@torch.inference_mode()
def _step(model: Decoder, cache: KVCache, ids: list[int], capture: dict[str, list] | None) -> np.ndarray:
    """Run `ids` (one chunk) at the cache's current length, write their K/V rows, return logits [S, V]."""
    count = len(ids)
    tokens = torch.tensor([ids], dtype=torch.int64)
    positions = torch.arange(cache.length, cache.length + count, dtype=torch.int64)[None, :]
    past_len = torch.from_numpy(cache.past_len())
    h = model.embed_tokens(tokens, positions)
    if capture is not None:
        capture["embed"].append(h[0].numpy().copy())
    for i, layer in enumerate(model.layers):
        past_k, past_v = torch.from_numpy(cache.keys[i]), torch.from_numpy(cache.values[i])
        h, k, v = layer(h, positions, past_k, past_v, past_len)
        k_rows, v_rows = k.numpy(), v.numpy()  # [1, n_kv, S, hd]
        cache.write(i, k_rows, v_rows, count)
        if capture is not None:
            capture["hidden"][i].append(h[0].numpy().copy())
            capture["keys"][i].append(k_rows[0].copy())
            capture["values"][i].append(v_rows[0].copy())
    cache.advance(count)
    return model.head(h)[0].float().numpy()


def torch_trace(model: Decoder, tokens: list[int], chunk: int, max_seq: int) -> Trace:
    """Teacher-forced pass over `tokens` in prefill chunks, recording everything a Trace holds."""
    need(len(tokens) <= max_seq, f"evaluation text: {len(tokens)} tokens do not fit max_seq={max_seq}")
    n_layers = model.cfg.n_layers
    capture: dict[str, list] = {"embed": [], "hidden": [[] for _ in range(n_layers)],
                                "keys": [[] for _ in range(n_layers)], "values": [[] for _ in range(n_layers)]}
    cache = new_cache(model, max_seq)
    # the runtime's chunk plan (PyTorch writes only real rows, so the "rows" layout's)
    calls = plan_calls(len(tokens), chunk, 0, max_seq, "rows")
    logits = [_step(model, cache, tokens[s:s + c], capture) for s, c, _ in calls]
    return Trace(
        logits=join_rows(logits, 0),
        embed=join_rows(capture["embed"], 0),
        hidden=[join_rows(rows, 0) for rows in capture["hidden"]],
        keys=[join_rows(rows, 1) for rows in capture["keys"]],
        values=[join_rows(rows, 1) for rows in capture["values"]],
    )


def torch_greedy(model: Decoder, prompt: list[int], max_new: int, chunk: int, max_seq: int,
                 eos_id: int | None) -> list[int]:
    """Greedy continuation of `prompt`: up to `max_new` tokens, stopping after EOS or a full cache.

    Ties go to the lowest token id (np.argmax returns the first maximum), as the runtime sampler does.
    """
    cache = new_cache(model, max_seq)
    logits = None
    for s, c, _ in plan_calls(len(prompt), chunk, 0, max_seq, "rows"):
        logits = _step(model, cache, prompt[s:s + c], None)
    out: list[int] = []
    while len(out) < max_new:
        token = int(np.argmax(logits[-1]))
        out.append(token)
        if token == eos_id or cache.free == 0:
            break
        logits = _step(model, cache, [token], None)
    return out


@torch.inference_mode()
def generate_tokens(model: Decoder, n_new: int, seed: int, bos_id: int, max_seq: int) -> list[int]:
    """[BOS] + `n_new` tokens sampled at temperature 1 with a fixed seed: evaluation text without a corpus.

    EOS does not stop the sampling (the text is only something the model finds likely, token by token).
    """
    need(n_new + 1 <= max_seq, f"--generated {n_new}: needs {n_new + 1} positions, the export has max_seq={max_seq}")
    gen = torch.Generator().manual_seed(seed)
    cache = new_cache(model, max_seq)
    tokens = [bos_id]
    logits = _step(model, cache, tokens, None)
    while len(tokens) < n_new + 1:
        probs = torch.softmax(torch.from_numpy(logits[-1]).double(), dim=-1)
        token = int(torch.multinomial(probs, 1, generator=gen))
        tokens.append(token)
        if len(tokens) < n_new + 1:
            logits = _step(model, cache, [token], None)
    return tokens
