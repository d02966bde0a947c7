"""The embedding and every layer of an in-place export as one graph (manifest format 4+, role "stack").

Why: a decoded token ran N + 2 onnxruntime sessions (embed, N layers, head), each Run with its fixed cost
(execution frame, thread-pool dispatch, Python binding); one graph is faster and holds one session's state
(docs/benchmarks.md, "Runtime design measurements").

The stack is built from the layer graphs themselves (the fp32 ones by `edgellm export`, the quantized ones by
`edgellm quantize --format fast`), so it computes exactly what they compute:
  inputs   tokens [1, S], seqlens_k, total_len, past_key.i / past_value.i for every layer
  outputs  hidden_out [1, S, D] (the last layer's), present_key.i / present_value.i (written in place)
  nodes    the embed graph's, then each layer's, values renamed `embed/...`, `layer_3/...`; layer i+1 reads
           layer i's hidden_out
Weights keep their external-data references (embed.data, layer_i.data): no byte is written twice. Its two
variants are merged into one graph like a layer's (pairing.py). The head stays its own graph (it runs on one row
only), its two variants paired the same way in `head.onnx` (format 9, `pair_head`): one session, whose S is also
any other count, the k + 1 rows of a speculative verification (runtime/speculative.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from edgellm.runtime.engine import Engine
from edgellm.runtime.errors import need
from edgellm.runtime.fileio import describe_files
from edgellm.runtime.graphio import FP16_CACHE_ATOL, graph_io, graph_paths
from edgellm.runtime.manifest import GraphSpec, Manifest
from edgellm.runtime.session import SessionConfig
from edgellm.runtime.variant import LONE_EXACT

from .lone import lone_rows
from .pairing import pair_layer, renamed_nodes

STACK_FILE = "stack.onnx"
LONE_FILE = "stack_lone.onnx"  # the stack without the spare attention row (lone.py)
HEAD_FILE = "head.onnx"
STACK_TOLERANCE = 1e-4  # stack vs its own layer graphs: the same nodes (measured: bit-identical logits)
LONE_DECODE_BOUND = 0.1  # lone-row vs stack decode logits, relative (SmolLM2 int4: 0.023; the prefill check is exact)


def _unit(model: onnx.ModelProto, prefix: str, feeds: dict[str, str], keep: set[str],
          inits: dict[str, onnx.TensorProto], nodes: list[onnx.NodeProto]) -> dict[str, str]:
    """Append one graph's nodes and initializers; return its output name -> name in the stack.

    `feeds`: its input name -> the stack value feeding it (others keep their names: shared inputs). `keep`:
    values that keep their names (the stack's outputs). An initializer whose name another graph already uses
    with other content is renamed with `prefix`."""
    names = dict(feeds)
    for t in model.graph.initializer:
        if t.name in inits and inits[t.name].SerializeToString() != t.SerializeToString():
            names[t.name] = prefix + t.name
        if names.get(t.name, t.name) not in inits:
            copy = onnx.TensorProto()
            copy.CopyFrom(t)
            copy.name = names.get(t.name, t.name)
            inits[copy.name] = copy
    for n in model.graph.node:
        need(not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute),
             f"internal: {prefix}{n.name}: graphs with subgraphs cannot be stacked")
        names.update({o: o if o in keep else prefix + o for o in n.output if o})
    nodes += renamed_nodes(model.graph.node, names, prefix)
    return {o.name: names[o.name] for o in model.graph.output}


def stack_graphs(embed: onnx.ModelProto, layers: list[onnx.ModelProto]) -> onnx.ModelProto:
    """One variant's stack from the embed graph and the layer graphs of the same S (in layer order)."""
    need(len(layers) > 0, "internal: nothing to stack")
    n = len(layers)
    keep = {o.name for m in layers for o in m.graph.output if o.name.startswith("present_")}
    nodes: list[onnx.NodeProto] = []
    inits: dict[str, onnx.TensorProto] = {}
    hidden = _unit(embed, "embed/", {}, keep, inits, nodes)["hidden"]
    inputs = list(embed.graph.input)
    outputs = []
    for i, layer in enumerate(layers):
        last = i == n - 1
        out = _unit(layer, f"layer_{i}/", {"hidden": hidden}, keep | ({"hidden_out"} if last else set()),
                    inits, nodes)
        hidden = out["hidden_out"]
        seen = {v.name for v in inputs}
        inputs += [v for v in layer.graph.input if v.name != "hidden" and v.name not in seen]
        outputs += [v for v in layer.graph.output if v.name != "hidden_out"]
    outputs.insert(0, next(v for v in layers[-1].graph.output if v.name == "hidden_out"))
    opsets: dict[str, int] = {}
    for m in (embed, *layers):
        for op in m.opset_import:
            opsets[op.domain] = max(opsets.get(op.domain, 0), op.version)
    graph = helper.make_graph(nodes, "stack", inputs, outputs, list(inits.values()))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                             ir_version=max(m.ir_version for m in (embed, *layers)),
                             producer_name=layers[0].producer_name, producer_version=layers[0].producer_version)


def write_stack(directory: Path, manifest: Manifest, variants: dict[int, list[onnx.ModelProto]]) -> list[GraphSpec]:
    """Write `stack.onnx` into `directory` from each variant's embed and layer graphs (S -> [embed, layer_0,
    ...], the graphs as written there), both variants merged into one graph; return its two manifest entries.
    An export whose attention has the spare row (format 10+) also gets `stack_lone.onnx` (lone.py) and its two:
    the caller writes format 13 then."""
    stacks = {seq: stack_graphs(models[0], models[1:]) for seq, models in variants.items()}
    stack = pair_layer(stacks[manifest.prefill_chunk], stacks[1])
    graphs = [("stack", STACK_FILE, stack)]
    if manifest.dims.spare > 0:
        graphs.append(("stack_lone", LONE_FILE, lone_rows(stack)[0]))
    specs = []
    for role, file, model in graphs:
        (directory / file).write_bytes(model.SerializeToString())
        for seq in (manifest.prefill_chunk, 1):
            inputs, outputs = graph_io(role, seq, None, manifest.dims)
            specs.append(GraphSpec(graph_paths(role, seq)[0], role, None, seq, file, None, inputs, outputs,
                                   paired=True))
    return specs


def pair_head(directory: Path, manifest: Manifest) -> Manifest:
    """Merge the head's two variant graphs (files in `directory`) into `head.onnx` (pairing.py; the same nodes,
    S symbolic) and point both manifest entries at it; the variant files leave the manifest's file list."""
    heads = sorted((g for g in manifest.graphs if g.role == "head"), key=lambda g: -g.seq)
    need(len(heads) == 2 and not any(g.paired for g in heads), "internal: pair_head needs both unpaired head variants")
    models = [onnx.load(str(directory / g.file), load_external_data=False) for g in heads]
    (directory / HEAD_FILE).write_bytes(pair_layer(models[0], models[1]).SerializeToString())
    old = {g.file for g in heads}
    graphs = tuple(replace(g, file=HEAD_FILE, paired=True) if g.role == "head" else g for g in manifest.graphs)
    files = {rel: f for rel, f in manifest.files.items() if rel not in old} | describe_files(directory, [HEAD_FILE])
    return replace(manifest, graphs=graphs, files=files)


def _relative(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max(1, max |ref|): the checks' one measure."""
    return float(np.abs(got - ref).max() / max(1.0, float(np.abs(ref).max())))


def _through_engine(directory: Path, manifest: Manifest, config: SessionConfig, tokens: Sequence[int],
                    n: int) -> tuple[Engine, np.ndarray, np.ndarray]:
    """The runtime's logits: tokens[:n] as a prompt (every row, `forward_rows`), then the rest one by one."""
    engine = Engine.open(Path(directory), manifest, config)
    rows = engine.forward_rows(list(tokens[:n]))
    steps = np.stack([engine.forward([t]).copy() for t in tokens[n:]])
    return engine, rows, steps


def stack_tolerance(manifest: Manifest) -> float:
    """How far a stack's logits may be from its layer graphs' (and a lone stack's prefill from the stack's): with an
    fp16 or int8 cache a last-bit difference in q, k or v (onnxruntime fuses the stack's nodes across layer
    boundaries, the layer graphs' not) can move a cached value by a whole step of its type (graphio.FP16_CACHE_ATOL;
    int8 caches measured 0 on SmolLM2-135M-Instruct int8 and int4)."""
    return STACK_TOLERANCE if manifest.kv_dtype == "float32" else FP16_CACHE_ATOL


def check_stack(directory: Path, manifest: Manifest, tokens: Sequence[int], decode_steps: int = 3) -> float:
    """Max relative |stack - layers| of the runtime Engine's logits, refused above STACK_TOLERANCE; the same
    tokens fed both ways: all but `decode_steps` as a prompt (prefill variant), the rest one by one (decode
    variant). (Not against quantize's prefill-graph logits: int4 kernels at S = 1 and S = chunk differ by ~1e-2
    themselves.)"""
    n = len(tokens) - decode_steps
    need(n > 0, "internal: the stack check needs more tokens than decode steps")
    runs = []
    for stack in (True, False):
        engine, rows, steps = _through_engine(directory, manifest, SessionConfig(stack=stack, exact=True),
                                               tokens, n)
        need(engine.stacked == stack, "internal: the stack check needs an export with a stack graph")
        runs.append(np.concatenate([rows, steps]))
        del engine
    diff = _relative(*runs)
    bound = stack_tolerance(manifest)
    need(diff <= bound, f"{directory}: the stack graph's logits differ from its layer graphs' by {diff:.3g} "
                        f"(relative; expected <= {bound:g})")
    return diff


def check_lone(directory: Path, manifest: Manifest, tokens: Sequence[int], decode_steps: int = 3) -> float:
    """The lone-row stack against the stack, through the runtime Engine: the rows of a prefill chunk (S >= 2,
    where the kernel computes both alike) must agree within STACK_TOLERANCE; returns the decode steps' max
    relative |lone - stack| — the kernel's lone-row summation order, ~1e-6 in fp32, up to ~1e-2 once int8
    activations round it — refused above LONE_DECODE_BOUND, and above 0 for a cache type whose lone rows the
    runtime takes as exact (runtime/variant.LONE_EXACT: greedy decoding and speculation then run it). The prefill is one chunk call: up to
    prefill_chunk of `tokens`, then `decode_steps` more one by one."""
    n = min(len(tokens) - decode_steps, manifest.prefill_chunk)
    need(n > 1, "internal: the lone-row check needs 2 tokens to prefill and the decode steps")
    runs = []
    for role in ("stack", "stack_lone"):
        engine, rows, steps = _through_engine(directory, manifest, SessionConfig(stack_graph=role),
                                              tokens[:n + decode_steps], n)
        runs.append((rows, steps))
        del engine
    (ref_rows, ref_steps), (rows, steps) = runs
    prefill = _relative(rows, ref_rows)
    bound = stack_tolerance(manifest)
    need(prefill <= bound, f"{directory}: the lone-row stack's prefill logits differ from the stack's by "
                           f"{prefill:.3g} (relative; expected <= {bound:g})")
    diff = _relative(steps, ref_steps)
    bound = 0.0 if manifest.kv_dtype in LONE_EXACT else LONE_DECODE_BOUND  # an exact lone stack: bit for bit
    need(diff <= bound, f"{directory}: the lone-row stack's decode logits differ from the stack's by "
                        f"{diff:.3g} (relative; expected <= {bound:g})")
    return diff
