"""Token sequences through an export's prefill graphs in onnxruntime: logits at every position and,
optionally, the input of every weight matmul (calibration).

Prefill graphs (S = prefill_chunk) run the sequence chunk by chunk with the runtime's KV-cache rule (the
last chunk padded, only real rows written), so one call per chunk yields the logits of every position, which
`Engine` (last position only) does not expose. Graphs are loaded from bytes so that capture outputs can be
added to a copy; their external data is resolved in the export directory via the session config
`session.model_external_initializers_file_folder_path`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.kvcache import KVCache, embed_feeds, plan_calls, step_feeds
from edgellm.runtime.manifest import Manifest
from edgellm.runtime.session import SessionConfig, session_options


def weight_inputs(graph: onnx.GraphProto) -> dict[str, str]:
    """{weight initializer: the activation it multiplies} for every MatMul/Gemm B that is a 2-D initializer."""
    inits = {t.name for t in graph.initializer if len(t.dims) == 2}
    return {n.input[1]: n.input[0] for n in graph.node
            if n.op_type in ("MatMul", "Gemm") and n.domain in ("", "ai.onnx") and n.input[1] in inits}


class _Graph:
    def __init__(self, directory: Path, file: str, capture: bool, config: SessionConfig) -> None:
        model = onnx.load(directory / file, load_external_data=False)
        self.outputs = [o.name for o in model.graph.output]
        self.weights = weight_inputs(model.graph) if capture else {}
        inputs = {v.name for v in model.graph.input}
        self.captured = sorted({a for a in self.weights.values() if a not in inputs and a not in self.outputs})
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

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.session.run(self.outputs + self.captured, feeds)
        return {**feeds, **dict(zip(self.outputs + self.captured, values, strict=True))}


class ExportRunner:
    """Sessions for the prefill variant of every graph of one export directory."""

    def __init__(self, directory: Path, manifest: Manifest, capture: bool = False,
                 config: SessionConfig | None = None, sample_every: int = 0, sample_rows: int = 0,
                 hessians: bool = False) -> None:
        """`capture`: accumulate mean |x| of every weight's input; with `sample_rows`, also keep up to that
        many input rows per weight, every `sample_every`-th real row (AWQ's scale search); with `hessians`,
        also sum x^T x [K, K] over every real row (GPTQ), once per activation shared by several weights."""
        self.hessian_sums: dict[str, np.ndarray] | None = {} if hessians else None   # activation -> X^T X
        self.hessian_of: dict[str, str] = {}                                         # weight -> activation
        self.manifest, self.seq = manifest, manifest.prefill_chunk
        self.sample_every, self.sample_rows = max(sample_every, 1), sample_rows
        self.samples: dict[str, list[np.ndarray]] = {}
        self._seen = 0                              # real rows fed so far (for the sampling stride)
        self.directory, self.capture, self.config = Path(directory), capture, config or SessionConfig()
        self.graphs: dict[tuple[str, int | None, int], _Graph] = {}
        for g in manifest.graphs:
            if g.seq == self.seq and g.role != "stack":  # the layer graphs it is made of run instead
                self.graphs[(g.role, g.layer, g.seq)] = _Graph(self.directory, g.file, capture, self.config)
        self.cache = KVCache(manifest.n_layers, manifest.n_kv_heads, manifest.max_seq, manifest.head_dim,
                             rows=manifest.dims.rows)
        self.abs_sum: dict[str, np.ndarray] = {}   # weight -> sum over real rows of |x| [K] (float64)
        self.rows: dict[str, int] = {}

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [T, V] of every position of `tokens` (a fresh context; at most max_seq tokens)."""
        m, cache = self.manifest, self.cache
        need(0 < len(tokens) <= m.max_seq, f"runner: {len(tokens)} tokens do not fit max_seq {m.max_seq}")
        cache.reset()
        rows = []
        for start, count, seq in plan_calls(len(tokens), self.seq, 0, m.max_seq, m.kv_layout):
            chunk = np.zeros((1, seq), np.int64)
            chunk[0, :count] = tokens[start:start + count]
            common = step_feeds(m.kv_layout, cache.length, seq, m.max_seq)
            if m.granularity == "model":
                feeds = {"tokens": chunk, **common}
                for i in range(m.n_layers):
                    feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = cache.keys[i], cache.values[i]
                out = self._run(("model", None, seq), feeds, count)
                for i in range(m.n_layers):
                    cache.write(i, out[f"present_key.{i}"], out[f"present_value.{i}"], count)
            else:
                position = embed_feeds(m.dims.embed_positions, cache.length, seq, m.max_seq)
                hidden = self._run(("embed", None, seq), {"tokens": chunk, **position}, count)["hidden"]
                for i in range(m.n_layers):
                    out = self._run(("layer", i, seq), {"hidden": hidden, **common, f"past_key.{i}": cache.keys[i],
                                                        f"past_value.{i}": cache.values[i]}, count)
                    cache.write_present(i, m.kv_layout, out[f"present_key.{i}"], out[f"present_value.{i}"], count)
                    hidden = out["hidden_out"]
                out = self._run(("head", None, seq), {"hidden": hidden}, count)
            cache.advance(count)
            self._seen += count
            rows.append(out["logits"][0, :count])
        return np.concatenate(rows)

    def _run(self, key: tuple[str, int | None, int], feeds: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
        spec = self.manifest.graph(key[0], key[2], key[1])
        if key not in self.graphs:  # an S = 1 graph, opened the first time the call plan needs it
            self.graphs[key] = _Graph(self.directory, spec.file, self.capture, self.config)
        graph = self.graphs[key]
        out = graph.run(feeds)
        summed: set[str] = set()
        for weight, act in graph.weights.items():
            x = out[act]
            x = x.reshape(-1, x.shape[-1])
            x = x[:count]                                           # [S, K]: only the real rows
            self.abs_sum[weight] = self.abs_sum.get(weight, 0.0) + np.abs(x).sum(axis=0, dtype=np.float64)
            self.rows[weight] = self.rows.get(weight, 0) + x.shape[0]
            if self.hessian_sums is not None:
                hkey = f"{key[0]}.{key[1]}/{act}"      # graph-unique: each layer names its inputs alike
                self.hessian_of[weight] = hkey
                if hkey not in summed:                 # once per activation and run
                    summed.add(hkey)
                    xf = x.astype(np.float32)
                    self.hessian_sums[hkey] = self.hessian_sums.get(hkey, 0.0) + xf.T @ xf
            if self.sample_rows and x.shape[0] == count:
                keep = x[(self._seen + np.arange(count)) % self.sample_every == 0]
                got = self.samples.setdefault(weight, [])
                room = self.sample_rows - sum(len(a) for a in got)
                if room > 0 and len(keep):
                    got.append(np.array(keep[:room], np.float32))
        return out

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
