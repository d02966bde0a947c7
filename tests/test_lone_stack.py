"""The lone-row stack (manifest format 13, edgellm/layout/lone.py): the stack without the spare attention row,
opened by sampled runs. Its graph is the stack's minus the spare row's nodes; its prefill rows are the stack's
bit for bit and its decode rows differ by the kernel's summation order only; export and quantize write and check
it (a quantize of a format-12 export upgrades it to 13); the Engine opens it only when asked (`exact=False`)
and then does not claim exact verification rows; the CLI asks for it when sampling."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgellm.cli import main
from edgellm.layout.lone import is_spare_row_node, lone_rows
from edgellm.layout.stacking import LONE_FILE, STACK_FILE, check_lone
from edgellm.quant import QuantizeOptions, quantize_export
from edgellm.runtime.engine import Engine
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.fileio import describe_files
from edgellm.runtime.manifest import FORMAT_VERSION, LONE_SINCE, MANIFEST, read_manifest
from edgellm.runtime.session import SessionConfig
from tests.export_helpers import default_export

PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 256, 7)]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> Path:
    return default_export(tmp_path_factory.mktemp("lone") / "fp32")


def test_the_lone_graph_is_the_stack_without_the_spare_row(fp32: Path) -> None:
    stack = onnx.load(str(fp32 / STACK_FILE), load_external_data=False)
    lone = onnx.load(str(fp32 / LONE_FILE), load_external_data=False)
    n = read_manifest(fp32).n_layers
    spare = [x for x in stack.graph.node if is_spare_row_node(x)]
    assert sorted(x.op_type for x in spare) == sorted(["Pad", "Add", "Add", "Slice"] * n)  # per layer
    assert not any(is_spare_row_node(x) for x in lone.graph.node)
    assert len(lone.graph.node) == len(stack.graph.node) - 4 * n
    # every other node as it was, reading the bypassed nodes' inputs; the graph's I/O unchanged
    assert [x.op_type for x in lone.graph.node] == [x.op_type for x in stack.graph.node if not is_spare_row_node(x)]
    assert lone.graph.input == stack.graph.input and lone.graph.output == stack.graph.output
    assert not any(t.name.endswith(("attn.extra_row", "attn.one", "attn.rows.end")) for t in lone.graph.initializer)
    assert lone_rows(stack)[0].SerializeToString() == lone.SerializeToString()      # what export wrote


def test_export_lists_and_checks_it(fp32: Path) -> None:
    m = read_manifest(fp32)
    assert m.format_version == FORMAT_VERSION >= LONE_SINCE
    lone = [g for g in m.graphs if g.role == "stack_lone"]
    assert {g.seq for g in lone} == {1, m.prefill_chunk} and all(g.paired and g.file == LONE_FILE for g in lone)
    assert m.graph("stack_lone", 1).inputs == m.graph("stack", 1).inputs
    assert 0 < m.verification["lone_vs_stack"] < 1e-4  # fp32: the kernel's summation order only


def test_the_engine_opens_it_only_when_asked(fp32: Path) -> None:
    m = read_manifest(fp32)
    exact, lone = (Engine.open(fp32, m, SessionConfig(exact=e)) for e in (True, False))
    assert (exact.stack_role, exact.exact_rows) == ("stack", True)
    assert (lone.stack_role, lone.exact_rows) == ("stack_lone", False)
    # a prefill chunk: the same rows bit for bit; decode steps and a verification: within fp32 rounding
    assert np.array_equal(exact.forward_rows(PROMPT), lone.forward_rows(PROMPT))
    for t in (5, 9, 200):
        a, b = exact.forward([t]), lone.forward([t])
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, float(np.abs(a).max()))
    a, b = exact.few_rows([7, 8, 9]), lone.few_rows([7, 8, 9])
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, float(np.abs(a).max()))
    assert exact.cache.length == lone.cache.length == len(PROMPT) + 6
    # without the stack the layer graphs run, exact either way
    layers = Engine.open(fp32, m, SessionConfig(stack=False, exact=False))
    assert not layers.stacked and np.array_equal(layers.forward(PROMPT), exact_last(fp32, m))


def test_a_default_generator_decodes_through_it_until_speculation_is_on(fp32: Path) -> None:
    """`SessionConfig.exact` None (the API's default): plain decoding runs the lone-row stack (no spare row to pay
    for); `speculate` reopens the engine on the spare-row stack once, keeping the context, so greedy speculation
    then gives the tokens plain decoding through that stack gives; `exact=False` is never reopened."""
    from edgellm.runtime.generator import Generator
    from edgellm.runtime.sampling import SamplingParams, StopParams

    greedy, stop = SamplingParams(temperature=0), StopParams(12)
    gen = Generator.open(fp32)
    assert (gen.engine.stack_role, gen.engine.exact_rows) == ("stack_lone", False)
    lone_first = gen.engine
    first = gen.complete(PROMPT, greedy, stop, ignore_eos=True, text=False).token_ids
    gen.speculate("off")
    assert gen.engine is lone_first                      # "off" needs no spare row
    gen.speculate("lookup", timed=False)
    assert (gen.engine.stack_role, gen.engine.exact_rows) == ("stack", True) and gen.engine.config.exact
    # the context survived the reopen: a kept-context continuation decodes after the first answer's rows
    more = gen.complete([5], greedy, stop, ignore_eos=True, keep_context=True, text=False)
    assert gen.cache.length == len(PROMPT) + len(first) + len(more.token_ids)
    spec = gen.complete(PROMPT, greedy, stop, ignore_eos=True, text=False).token_ids
    reopened = gen.engine
    gen.speculate("off")
    gen.speculate("lookup", timed=False)
    assert gen.engine is reopened                         # once
    assert gen.complete(PROMPT, greedy, stop, ignore_eos=True, text=False).token_ids == spec
    exact_plain = Generator.open(fp32, config=SessionConfig(exact=True))
    assert exact_plain.complete(PROMPT, greedy, stop, ignore_eos=True, text=False).token_ids == spec
    sampled = Generator.open(fp32, config=SessionConfig(exact=False))
    sampled.speculate("lookup")
    assert sampled.engine.stack_role == "stack_lone"
    layers = Generator.open(fp32, config=SessionConfig(stack=False))
    engine = layers.engine
    layers.speculate("lookup")
    assert layers.engine is engine                        # the layer graphs: no stack to change
    with pytest.raises(EdgeError, match="exact: expected true, false or null, got 'yes'"):
        SessionConfig(exact="yes").validate()


def test_a_reopen_that_fails_leaves_the_generator_decoding(fp32: Path, tmp_path: Path) -> None:
    """The spare-row stack's session cannot be created (an unknown op; the manifest not verified): `speculate`
    raises the one-line error and the Generator keeps decoding through the lone-row stack it had."""
    import shutil

    from edgellm.runtime.generator import Generator
    from edgellm.runtime.sampling import SamplingParams, StopParams

    broken = tmp_path / "broken"
    shutil.copytree(fp32, broken)
    gen = Generator.open(broken, verify=False)
    greedy, stop = SamplingParams(temperature=0), StopParams(6)
    before = gen.complete(PROMPT, greedy, stop, ignore_eos=True, text=False).token_ids
    stack = onnx.load(str(broken / STACK_FILE), load_external_data=False)
    next(x for x in stack.graph.node if is_spare_row_node(x)).op_type = "NoSuchOp"
    onnx.save(stack, str(broken / STACK_FILE))
    with pytest.raises(EdgeError, match=STACK_FILE):
        gen.speculate("lookup")
    assert gen.engine.stack_role == "stack_lone"
    assert gen.complete(PROMPT, greedy, stop, ignore_eos=True, text=False).token_ids == before


def test_a_named_stack_graph_is_the_one_opened(fp32: Path) -> None:
    """`SessionConfig.stack_graph` overrides what `exact` and the cache type pick (the stacks' comparison uses it);
    asking for a lone stack an export does not have is a one-line error."""
    m = read_manifest(fp32)
    assert Engine.open(fp32, m, SessionConfig(exact=False, stack_graph="stack")).stack_role == "stack"
    assert Engine.open(fp32, m, SessionConfig(stack_graph="stack_lone")).stack_role == "stack_lone"
    no_lone = dataclasses.replace(m, graphs=tuple(g for g in m.graphs if g.role != "stack_lone"))
    with pytest.raises(EdgeError, match="stack_graph: stack_lone asked for, but the export has no lone-row stack"):
        Engine.open(fp32, no_lone, SessionConfig(stack_graph="stack_lone"))
    with pytest.raises(EdgeError, match="stack_graph: expected auto, stack or stack_lone, got 'lone'"):
        SessionConfig(stack_graph="lone").validate()


def exact_last(directory: Path, m) -> np.ndarray:
    return Engine.open(directory, m, SessionConfig(stack=False)).forward(PROMPT).copy()


def test_a_wiring_error_is_refused(fp32: Path, tmp_path: Path) -> None:
    """The Pad and Slice bypassed but the lengths still + 1: attention then reads a row that is not there."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for rel in read_manifest(fp32).files:
        (bad / rel).write_bytes((fp32 / rel).read_bytes())
    stack = onnx.load(str(fp32 / STACK_FILE), load_external_data=False)
    keep_adds = onnx.ModelProto()
    keep_adds.CopyFrom(stack)
    bypass = {x.output[0]: x.input[0] for x in stack.graph.node if is_spare_row_node(x) and x.op_type != "Add"}
    nodes = [x for x in keep_adds.graph.node if x.output[0] not in bypass]
    for x in nodes:
        x.input[:] = [bypass.get(i, i) for i in x.input]
    del keep_adds.graph.node[:]
    keep_adds.graph.node.extend(nodes)
    (bad / LONE_FILE).write_bytes(keep_adds.SerializeToString())
    m = read_manifest(fp32)
    m = dataclasses.replace(m, files={**m.files, **describe_files(bad, [LONE_FILE])})
    m.write(bad)
    with pytest.raises(EdgeError, match="lone-row stack's prefill logits differ from the stack's"):
        check_lone(bad, m, PROMPT + [4, 5, 6])


def test_quantize_writes_it_and_upgrades_a_format_12_export(fp32: Path, tmp_path: Path, capsys) -> None:
    """A format-12 export (no stack_lone) quantizes to a 13 with one: the stack is rebuilt there anyway. Asked
    for the lone stack, `run` on the 12 says it decodes with the exact one."""
    old = tmp_path / "v12"
    old.mkdir()
    m = read_manifest(fp32)
    m12 = dataclasses.replace(m, graphs=tuple(g for g in m.graphs if g.role != "stack_lone"), format_version=12,
                              files={k: v for k, v in m.files.items() if k != LONE_FILE},
                              verification={k: v for k, v in m.verification.items() if k != "lone_vs_stack"})
    for rel in m12.files:
        (old / rel).write_bytes((fp32 / rel).read_bytes())
    m12.write(old)
    assert read_manifest(old).format_version == 12
    assert Engine.open(old, m12, SessionConfig(exact=False)).stack_role == "stack"  # nothing else to open
    assert main(["run", str(old), "--prompt-ids", "5,6", "--max-new-tokens", "2", "--exact-decode", "off"]) == 0
    assert "--exact-decode off: " + str(old) + " (format 12) has no lone-row stack" in capsys.readouterr().err
    out = quantize_export(old, tmp_path / "int8", QuantizeOptions(bits=8), progress=False, log=lambda _: None).manifest
    assert out.format_version == LONE_SINCE and {g.role for g in out.graphs} >= {"stack", "stack_lone"}
    assert 0 <= out.verification["lone_vs_stack"] <= 0.1
    assert Engine.open(tmp_path / "int8", out, SessionConfig(exact=False)).stack_role == "stack_lone"


def test_the_manifest_refuses_it_in_a_12_or_without_a_stack(fp32: Path) -> None:
    m = read_manifest(fp32)
    with pytest.raises(EdgeError, match="stack_lone needs format_version 13, this manifest says 12"):
        dataclasses.replace(m, format_version=12)
    with pytest.raises(EdgeError, match="a stack_lone graph needs the stack graph"):
        dataclasses.replace(m, graphs=tuple(g for g in m.graphs if g.role != "stack"))
    doc = json.loads((fp32 / MANIFEST).read_text())
    lone = next(g for g in doc["graphs"] if g["role"] == "stack_lone" and g["seq"] == 1)
    lone["paired"] = False
    with pytest.raises(EdgeError, match="the stack_lone graph's two variants must be paired in one file"):
        type(m).from_json(json.dumps(doc))


@pytest.mark.parametrize("temperature,stack", [("0", "stack"), ("0.8", "stack_lone")])
def test_the_cli_samples_through_it_and_decodes_greedy_exactly(fp32: Path, capsys, temperature: str,
                                                               stack: str) -> None:
    """`--exact-decode auto`: greedy keeps the exact stack, a sampled run opens the lone one (`edgellm bench`
    names the stack; `run` decodes the same way); `--speculative auto` is lookup for both (greedy: exact rows;
    sampled: rejection sampling), and off for greedy decoding through the lone stack (`--exact-decode off`)."""
    args = ["run", str(fp32), "--prompt-ids", ",".join(map(str, PROMPT * 2)), "--max-new-tokens", "6",
            "--temperature", temperature, "--seed", "1", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stats"].get("speculative") is not None and len(doc["token_ids"]) == 6
    assert main(["run", str(fp32), "--prompt-ids", "5,6", "--max-new-tokens", "2", "--temperature", "0",
                 "--exact-decode", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"].get("speculative") is None
    from edgellm.cli.speculation import exact_decode
    from edgellm.runtime.generator import Generator
    exact = exact_decode("auto", float(temperature))
    assert Generator.open(fp32, config=SessionConfig(exact=exact)).engine.stack_role == stack
