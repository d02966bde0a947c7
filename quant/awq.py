"""AWQ's scale migration (Lin et al., "AWQ: Activation-aware Weight Quantization", 2023), on ONNX graphs.

A weight's salient input channels (large mean |x|) are scaled up before quantization, W' = W diag(s), and
whatever produces its input is scaled down by the same s, so the float model computes the same thing:
  gain  an RMSNorm gain feeding only matmuls, Mul(x_hat, g) -> MatMul(., W):  g' = g / s, W' = W diag(s)
        (or the gamma of a fused SkipSimplifiedLayerNormalization, whose output 0 is x_hat * g)
        (attn_norm -> qkv, mlp_norm -> gate_up, an untied final norm -> lm_head)
  up    SwiGLU's down(silu(gate) * up): gate_up's up rows (F..2F) / s, down' = down diag(s)
Per group, as AWQ searches: s = mean|x|^a / sqrt(max * min) for a in 0, 0.05, .., 1, keeping the a with
the least output error ||X (Q(W diag(s)) diag(1/s) - W)^T||^2 over the calibration rows X (a = 0 is plain
RTN, so the result is never worse on them). The clip search then runs on W' with act scales mean|x| / s.
Not migrated: v -> o (it would rescale the V rows the KV cache holds and `edgellm diff` compares) and q/k.
Only groups whose every weight is quantized to 4 bits by the awq method take part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .calibrate import Calibration
from .plan import QuantPlan, WeightSite
from .schemes import Scheme, dequantize, quantize

ALPHAS = np.linspace(0.0, 1.0, 21)


@dataclass(frozen=True)
class Group:
    kind: str                  # "gain" | "up"
    source: str                # the gain [K], or gate_up (B [D, 2F]) whose up columns are divided by s
    weights: tuple[str, ...]   # MatMul B initializers [K, N] whose input channels (rows) are multiplied by s


def find_groups(graph: onnx.GraphProto) -> list[Group]:
    """Every migration that leaves the float graph's outputs unchanged (see the module docstring)."""
    inits = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in set(n.input):
            consumers.setdefault(name, []).append(n)
    outputs = {o.name for o in graph.output}
    groups = []
    for n in graph.node:
        if n.output[0] in outputs:
            continue
        if n.op_type == "Mul" and n.domain in ("", "ai.onnx"):
            candidates = list(n.input)
        elif n.op_type == "SkipSimplifiedLayerNormalization" and n.domain == "com.microsoft":
            candidates = [n.input[2]]  # gamma scales output 0 only; output 3 (the residual sum) has no gain
        else:
            continue
        gains = [i for i in candidates
                 if i in inits and len(inits[i].dims) == 1 and inits[i].data_type == TensorProto.FLOAT]
        if len(gains) != 1 or len(consumers[gains[0]]) != 1:
            continue
        users = consumers.get(n.output[0], [])
        k = inits[gains[0]].dims[0]
        if users and all(u.op_type == "MatMul" and u.domain in ("", "ai.onnx") and u.input[0] == n.output[0]
                         and u.input[1] in inits and list(inits[u.input[1]].dims)[:1] == [k]
                         and len(inits[u.input[1]].dims) == 2 for u in users):
            groups.append(Group("gain", gains[0], tuple(dict.fromkeys(u.input[1] for u in users))))
    for name, t in inits.items():
        gate_up = name[: -len("down.weight")] + "gate_up.weight" if name.endswith(".mlp.down.weight") else ""
        g = inits.get(gate_up)
        if g is not None and len(t.dims) == 2 and len(g.dims) == 2 and g.dims[1] == 2 * t.dims[0]:
            groups.append(Group("up", gate_up, (name,)))
    # a weight read by anything but matmuls as B (a tied table's Gather) must keep its values
    return [g for g in groups if all(n.op_type == "MatMul" and list(n.input).index(w) == 1
                                     for w in g.weights for n in consumers.get(w, []))]


def apply_group(get: Callable[[str], np.ndarray], arrays: dict[str, np.ndarray], group: Group,
                s: np.ndarray) -> None:
    """Record in `arrays` the migrated weights and source for scales s [K]; `get` reads current values."""
    for w in group.weights:
        arrays[w] = get(w) * s[:, None]                  # B [K, N]: row k is input channel k
    src = get(group.source)
    if group.kind == "gain":
        arrays[group.source] = src / s
    else:
        f = s.shape[0]
        src = src.copy()
        src[:, f:] /= s[None, :]                         # gate_up B [D, 2F]: columns F..2F are up
        arrays[group.source] = src


def output_error(x: np.ndarray, weights: list[np.ndarray], scheme: Scheme, s: np.ndarray) -> float:
    """sum over weights of ||X (Q(W diag(s)) diag(1/s) - W)^T||^2; weights canonical [N, K]."""
    total = 0.0
    for w in weights:
        delta = dequantize(quantize(w * s[None, :], scheme)) / s[None, :] - w
        total += float(np.sum((x @ delta.T) ** 2, dtype=np.float64))
    return total


class Migrator:
    """Searches each group's scales once (on the first graph variant holding it) and applies the same
    scales to every variant, so the migrated weights are byte-identical across them."""

    def __init__(self, plan: QuantPlan, calibration: Calibration) -> None:
        self.plan, self.calibration = plan, calibration
        self.scales: dict[Group, np.ndarray | None] = {}
        self.alpha: dict[str, float] = {}               # weight -> the alpha kept (reports)

    def _spec_scheme(self, name: str, shape: tuple[int, int]) -> Scheme | None:
        spec = self.plan.choose(WeightSite(name, "MatMul", "", name.removesuffix(".weight"), shape))
        if spec is None or spec.scheme.bits != 4 or spec.method != "mse":
            return None
        return spec.scheme

    def _search(self, group: Group, get: Callable[[str], np.ndarray]) -> np.ndarray | None:
        if "embed.weight" in group.weights:
            # a tied lm_head (its MatMul reads the embedding table): migrating it would leave the lookup
            # needing the unmigrated table, i.e. a second quantized copy (quant/tied.py shares one)
            return None
        weights = [np.ascontiguousarray(get(w).T) for w in group.weights]           # canonical [N, K]
        schemes = {self._spec_scheme(w, a.shape) for w, a in zip(group.weights, weights, strict=True)}
        x = self.calibration.samples.get(group.weights[0])
        mean = self.calibration.act_scales.get(group.weights[0])
        if len(schemes) != 1 or None in schemes or x is None or mean is None:
            return None
        scheme = schemes.pop()
        best = (output_error(x, weights, scheme, np.ones_like(mean)), 0.0)
        for a in ALPHAS[1:]:
            s = mean.astype(np.float64) ** a
            s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
            best = min(best, (output_error(x, weights, scheme, s), float(a)))
        for w in group.weights:
            self.alpha[w] = best[1]
        if best[1] == 0.0:
            return None
        s = mean.astype(np.float64) ** best[1]
        return (s / np.sqrt(s.max() * s.min())).astype(np.float32)

    def apply(self, model: onnx.ModelProto) -> None:
        """Migrate every group of `model` in place (initializers loaded) and adjust the plan's act scales."""
        inits = {t.name: t for t in model.graph.initializer}
        arrays: dict[str, np.ndarray] = {}

        def get(name: str) -> np.ndarray:
            return arrays[name] if name in arrays else numpy_helper.to_array(inits[name])

        for group in find_groups(model.graph):
            if group not in self.scales:
                self.scales[group] = self._search(group, get)
            s = self.scales[group]
            if s is None:
                continue
            apply_group(get, arrays, group, s)
            for w in group.weights:          # the migrated weight sees x / s
                self.plan.act_scales[w] = self.calibration.act_scales[w] / s   # type: ignore[index]
        for name, value in arrays.items():
            inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value, np.float32), name))
