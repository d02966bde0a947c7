"""One export's trace against the reference's: the per-layer, logit and perplexity sections of a variant."""

from __future__ import annotations

from typing import Any

from .metrics import first_jump, largest_jump, logit_metrics, perplexity, tensor_errors
from .trace import Trace

NOTE_LAYER = "Layer-granularity export: every layer graph ran on its own, so hidden states and K/V rows are observed."
NOTE_MODEL = ("Model-granularity export: hidden states between layers are not graph outputs, so per-layer errors "
              "cover only the K/V rows each layer writes (present_*). Layer i's K/V carry the error of its input "
              "(layers < i) plus its own q/k/v projection; an MLP fault in layer i first shows in layer i+1's K/V. "
              "The logit metrics below cover the rest.")


def per_layer(ref: Trace, got: Trace, jump_factor: float, jump_floor: float) -> dict[str, Any]:
    """Errors of the embedding output and, per layer, of the hidden state after it and its K/V rows.

    A layer's `error` is the largest relative RMS error among its observed tensors (hidden, K, V); the
    drift rule (`metrics.first_jump`) runs on these, with the embedding's error as the baseline.
    """
    embed = tensor_errors(ref.embed, got.embed) if got.embed is not None and ref.embed is not None else None
    layers = []
    for i in range(len(ref.keys)):
        hidden = tensor_errors(ref.hidden[i], got.hidden[i]) if got.hidden is not None and ref.hidden else None
        key = tensor_errors(ref.keys[i], got.keys[i])
        value = tensor_errors(ref.values[i], got.values[i])
        error = max(e["rel_rms"] for e in (hidden, key, value) if e is not None)
        layers.append({"layer": i, "hidden": hidden, "key": key, "value": value, "error": error})
    errors = [entry["error"] for entry in layers]
    baseline = embed["rel_rms"] if embed is not None else None
    return {
        "available": (["embed", "hidden"] if got.hidden is not None else []) + ["key", "value"],
        "note": NOTE_LAYER if got.hidden is not None else NOTE_MODEL,
        "embed": embed,
        "layers": layers,
        "first_drift_layer": first_jump(errors, jump_factor, jump_floor, baseline),
        "largest_jump_layer": largest_jump(errors, jump_floor, baseline),
        "worst_rel_rms": max(errors) if errors else None,
    }


def logits_and_ppl(ref: Trace, got: Trace, tokens: list[int]) -> tuple[dict[str, Any], dict[str, float]]:
    """(logit metrics, {ppl, ref_ppl, delta, delta_rel}) over the evaluation tokens."""
    ref_ppl, got_ppl = perplexity(ref.logits, tokens), perplexity(got.logits, tokens)
    ppl = {"ppl": got_ppl, "ref_ppl": ref_ppl, "delta": got_ppl - ref_ppl, "delta_rel": got_ppl / ref_ppl - 1.0}
    return logit_metrics(ref.logits, got.logits), ppl


def greedy_agreement(ref_runs: list[list[int]], got_runs: list[list[int]], starts: list[int],
                     prompt_len: int) -> dict[str, Any]:
    """Per prompt: how many greedy tokens the export generates identically before the first divergence.

    `agreed`/`total` sum over prompts, `total` counting PyTorch's tokens (a continuation stops early at EOS
    or a full cache); `identical` counts the prompts whose whole continuations are equal.
    """
    prompts = []
    for start, ref, got in zip(starts, ref_runs, got_runs, strict=True):
        agree = next((j for j, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
        prompts.append({"start": start, "prompt_len": prompt_len, "reference": ref, "export": got, "agree": agree})
    agreed = sum(p["agree"] for p in prompts)
    total = sum(len(p["reference"]) for p in prompts)
    return {"prompts": prompts, "agreed": agreed, "total": total, "agreement": agreed / total if total else 1.0,
            "identical": sum(p["reference"] == p["export"] for p in prompts)}
