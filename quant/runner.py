"""Token sequences through an export in onnxruntime, driven by the runtime's `Engine`: logits at every position
(`export_logits`) and, for calibration, the input of every weight matmul (`Calibrator`).

Both feed a fresh context through `Engine.forward_rows` (the runtime's graph calls, sessions and cache rule; the
layer graphs, not the stack, so each graph is seen). Capture: the Engine's hook hands each graph's inputs to a
probe, a copy of that graph with the A input of every weight MatMul added as an output, asked for those only
(onnxruntime runs only the nodes they need). Probes are loaded from bytes, their external data resolved in the
export directory via the session config `session.model_external_initializers_file_folder_path`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from edgellm.runtime.engine import Engine, GraphRun
from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.manifest import Manifest
from edgellm.runtime.session import SessionConfig, session_options


def weight_inputs(graph: onnx.GraphProto) -> dict[str, str]:
    """{weight initializer: the activation it multiplies} for every MatMul/Gemm B that is a 2-D initializer."""
    inits = {t.name for t in graph.initializer if len(t.dims) == 2}
    return {n.input[1]: n.input[0] for n in graph.node
            if n.op_type in ("MatMul", "Gemm") and n.domain in ("", "ai.onnx") and n.input[1] in inits}


def export_logits(directory: Path, manifest: Manifest, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Logits [T, V] of every position of each sequence (each from a fresh context; at most max_seq tokens):
    row t predicts tokens[t + 1]."""
    engine = Engine.open(Path(directory), manifest, SessionConfig(stack=False))
    out = []
    for tokens in sequences:
        need(0 < len(tokens) <= manifest.max_seq, f"runner: {len(tokens)} tokens do not fit max_seq {manifest.max_seq}")
        engine.cache.reset()
        out.append(engine.forward_rows(list(tokens)))
    return out


class _Probe:
    """One graph with the A input of every weight MatMul as an extra output."""

    def __init__(self, directory: Path, file: str, config: SessionConfig) -> None:
        model = onnx.load(directory / file, load_external_data=False)
        self.weights = weight_inputs(model.graph)
        io = {v.name for v in model.graph.input} | {o.name for o in model.graph.output}
        self.captured = sorted({a for a in self.weights.values() if a not in io})
        for name in self.captured:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
        options = session_options(config, prepack=False)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(directory))
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), options,
                                                providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime's own exception types
            raise EdgeError(f"{directory / file}: onnxruntime cannot load this graph "
                            f"({' '.join(str(err).split())[:300]})") from None

    def activations(self, run: GraphRun) -> dict[str, np.ndarray]:
        """Every tensor a weight multiplies in this run: a graph input or output, or a captured one."""
        values = self.session.run(self.captured, run.inputs) if self.captured else []
        return {**run.inputs, **run.outputs, **dict(zip(self.captured, values, strict=True))}


class Calibrator:
    """Statistics of every weight's input over the sequences `feed` runs through an export."""

    def __init__(self, directory: Path, manifest: Manifest, config: SessionConfig | None = None,
                 sample_every: int = 0, sample_rows: int = 0, hessians: bool = False) -> None:
        """Accumulates mean |x| of every weight's input; with `sample_rows`, also keeps up to that many input
        rows per weight, every `sample_every`-th real row (AWQ's scale search); with `hessians`, also sums
        x^T x [K, K] over every real row (GPTQ), once per activation shared by several weights."""
        self.directory, self.config = Path(directory), config or SessionConfig()
        self.engine = Engine.open(self.directory, manifest, SessionConfig(**{**vars(self.config), "stack": False}))
        self.hessian_sums: dict[str, np.ndarray] | None = {} if hessians else None   # activation -> X^T X
        self.hessian_of: dict[str, str] = {}                                         # weight -> activation
        self.sample_every, self.sample_rows = max(sample_every, 1), sample_rows
        self.samples: dict[str, list[np.ndarray]] = {}
        self._seen = 0                              # real rows fed before the current sequence (sampling stride)
        self.probes: dict[str, _Probe] = {}         # graph file -> its probe (a paired file serves both S)
        self.abs_sum: dict[str, np.ndarray] = {}   # weight -> sum over real rows of |x| [K] (float64)
        self.rows: dict[str, int] = {}

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Run `tokens` from a fresh context (at most max_seq), accumulating; their logits [T, V]."""
        m = self.engine.manifest
        need(0 < len(tokens) <= m.max_seq, f"runner: {len(tokens)} tokens do not fit max_seq {m.max_seq}")
        self.engine.cache.reset()
        logits = self.engine.forward_rows(list(tokens), self._watch)
        self._seen += len(tokens)
        return logits

    def _watch(self, run: GraphRun) -> None:
        spec, count = run.spec, run.count
        if spec.file not in self.probes:
            self.probes[spec.file] = _Probe(self.directory, spec.file, self.config)
        probe = self.probes[spec.file]
        out = probe.activations(run)
        summed: set[str] = set()
        for weight, act in probe.weights.items():
            x = out[act]
            x = x.reshape(-1, x.shape[-1])[:count]                  # [count, K]: only the real rows
            self.abs_sum[weight] = self.abs_sum.get(weight, 0.0) + np.abs(x).sum(axis=0, dtype=np.float64)
            self.rows[weight] = self.rows.get(weight, 0) + x.shape[0]
            if self.hessian_sums is not None:
                hkey = f"{spec.role}.{spec.layer}/{act}"   # graph-unique: each layer names its inputs alike
                self.hessian_of[weight] = hkey
                if hkey not in summed:                 # once per activation and run
                    summed.add(hkey)
                    xf = x.astype(np.float32)
                    self.hessian_sums[hkey] = self.hessian_sums.get(hkey, 0.0) + xf.T @ xf
            if self.sample_rows and x.shape[0] == count:
                keep = x[(self._seen + run.start + np.arange(count)) % self.sample_every == 0]
                got = self.samples.setdefault(weight, [])
                room = self.sample_rows - sum(len(a) for a in got)
                if room > 0 and len(keep):
                    got.append(np.array(keep[:room], np.float32))

    def sampled(self) -> dict[str, np.ndarray]:
        """Kept input rows [R, K] float32 of every weight (see `sample_rows`)."""
        return {w: np.concatenate(parts) for w, parts in self.samples.items() if parts}

    def hessians(self) -> dict[str, np.ndarray]:
        """X^T X [K, K] float32 of every weight seen (weights reading one activation share the array)."""
        sums = self.hessian_sums or {}
        return {w: sums[a] for w, a in self.hessian_of.items() if a in sums}

    def act_scales(self) -> dict[str, np.ndarray]:
        """mean |x| per input channel [K] float32 of every weight seen (a tiny floor keeps dead channels in)."""
        scales = {}
        for weight, total in self.abs_sum.items():
            mean = total / max(self.rows[weight], 1)
            scales[weight] = np.maximum(mean, 1e-3 * float(mean.mean()) + 1e-12).astype(np.float32)
        return scales
