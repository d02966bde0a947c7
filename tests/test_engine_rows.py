"""The Engine as the one driver (issue 25): `forward_rows` gives every fed token's logits, equal to PyTorch's full
forward and to what successive single-token forwards return; its hook sees each graph's bound buffers, equal to
what a standalone onnxruntime session of that graph returns for the same feeds. On every layout: layer graphs
with the "rows" cache and with "inplace" fused layers (stack graph or not), one model graph, and Gemma 3's ring
caches (a sliding window shorter than the context) in both."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edgellm.export import ExportOptions, export_model
from edgellm.runtime.engine import Engine, GraphRun
from edgellm.runtime.kvcache import step_feeds
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.session import SessionConfig
from tests.export_helpers import tiny_model, torch_logits

CHUNK, MAX_SEQ = 8, 64
# (preset, granularity, attention): rows layer graphs, inplace fused layers (+ stack), one model graph; Gemma 3's
# layer 0 is a sliding window of 6 (a ring cache) in the inplace and rows layouts
CASES = [("llama2", "layer", "standard"), ("llama2", "layer", "fused"), ("llama2", "model", "standard"),
         ("gemma3", "layer", "fused"), ("gemma3", "model", "standard")]
TOKENS = [int(t) for t in np.random.default_rng(5).integers(0, 256, 30)]  # > 3 chunks, past the window
PROMPT = 19  # 2 chunks + a padded one of 3


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def export(request, tmp_path_factory) -> tuple[object, Path]:
    preset, granularity, attention = request.param
    model = tiny_model(preset)
    out = tmp_path_factory.mktemp("rows") / "out"
    export_model(model, out, ExportOptions(max_seq=MAX_SEQ, prefill_chunk=CHUNK, granularity=granularity,
                                           attention=attention), progress=False, log=lambda _: None)
    return model, out


def close(got: np.ndarray, want: np.ndarray, tol: float = 1e-4) -> bool:
    return float(np.abs(got - want).max()) <= tol * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("stack", [True, False])
def test_forward_rows_match_torch_and_single_forwards(export, stack) -> None:
    model, out = export
    m = read_manifest(out)
    want = torch_logits(model, TOKENS)
    engine = Engine.open(out, m, SessionConfig(stack=stack))
    rows = np.concatenate([engine.forward_rows(TOKENS[:PROMPT])] +
                          [engine.forward_rows(TOKENS[t:t + 1]) for t in range(PROMPT, len(TOKENS))])
    assert rows.shape == (len(TOKENS), m.vocab_size) and engine.cache.length == len(TOKENS)
    assert close(rows, want)
    # the last row is what forward returns for the same feed; token by token, every row is
    single = Engine.open(out, m, SessionConfig(stack=stack))
    assert close(single.forward(TOKENS[:PROMPT]).copy(), rows[PROMPT - 1], 1e-5)
    single.cache.reset()
    assert close(np.stack([single.forward([t]).copy() for t in TOKENS]), rows, 1e-5)
    # a short forward after a rewind (speculative decoding's verification): the rows of the first pass again
    if not any(engine.cache.ring):
        engine.cache.rewind(PROMPT)
        again = engine.forward_rows(TOKENS[PROMPT:PROMPT + 5])
        assert close(again, rows[PROMPT:PROMPT + 5], 1e-5)


@pytest.mark.parametrize("stack", [True, False])
def test_hook_sees_each_graphs_outputs(export, stack) -> None:
    _, out = export
    m = read_manifest(out)
    engine = Engine.open(out, m, SessionConfig(stack=stack, threads=1))
    runs: list[GraphRun] = []

    def hook(run: GraphRun) -> None:  # the buffers are overwritten by later runs: keep copies
        runs.append(GraphRun(run.spec, {k: v.copy() for k, v in run.inputs.items()},
                             {k: v.copy() for k, v in run.outputs.items()}, run.start, run.count))

    rows = engine.forward_rows(TOKENS[:PROMPT], hook)
    rows = np.concatenate([rows, engine.forward_rows(TOKENS[PROMPT:PROMPT + 1], hook)])
    body = ([engine.stack_role] if engine.stacked else ["embed"] + [f"layer_{i}" for i in range(m.n_layers)]) + ["head"]
    order = ["model"] if m.granularity == "model" else body
    calls = [(0, 8, 8), (8, 8, 8), (16, 3, 8), (19, 1, 1)]
    assert [(r.spec.name, r.start, r.count) for r in runs] == [
        (f"{name}.{'decode' if seq == 1 else 'prefill'}", start, count)
        for start, count, seq in calls for name in order]
    sessions: dict[str, ort.InferenceSession] = {}
    for run in runs:
        rule = step_feeds(m.kv_layout if run.spec.role in ("layer", "stack", "stack_lone") else "rows", run.start, run.spec.seq,
                          m.max_seq)  # the kvcache rule: the position inputs the Engine wrote in place
        for name in set(rule) & set(run.inputs):
            assert np.array_equal(run.inputs[name].reshape(rule[name].shape), rule[name]), (run.spec.name, name)
        if run.spec.file not in sessions:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            sessions[run.spec.file] = ort.InferenceSession(str(out / run.spec.file), opts,
                                                           providers=["CPUExecutionProvider"])
        names = list(run.outputs)
        alone = dict(zip(names, sessions[run.spec.file].run(names, run.inputs), strict=True))
        for name in names:
            got, want = run.outputs[name], alone[name]
            if name.startswith("present_") and got.shape[2] != run.spec.seq:  # inplace: the whole cache, whose
                # other rows a standalone run (separate buffers) need not copy: the rows of the fed positions
                slots = np.arange(run.start, run.start + run.count) % got.shape[2]
                got, want = got[:, :, slots], want[:, :, slots]
            assert close(got, want, 1e-6), (run.spec.name, name)
    # the logits rows are the head's (model's) real output rows
    heads = [r for r in runs if r.spec.role in ("head", "model")]
    assert np.array_equal(rows, np.concatenate([r.outputs["logits"][0, :r.count] for r in heads]))
