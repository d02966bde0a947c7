"""The onnxruntime generator against PyTorch and against its own contract: greedy tokens, chunked prefill,
a full context, seeded sampling, streaming of split UTF-8 characters, stop strings, EOS, kept context."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgellm.model import PRESETS
from edgellm.runtime import Generator, Result, TokenEvent
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.sampling import SamplingParams, StopParams, sample
from tests.runtime_fixtures import CHAIN, OPTIONS, bigram_export, tiny_export, torch_greedy

GREEDY = SamplingParams(temperature=0.0)
PROMPT_LEN = 19  # 2 full chunks of 8 + 3 real rows in a padded third
MAX_SEQ = OPTIONS["max_seq"]


def prompt(n: int, vocab: int, seed: int = 7) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory, model = tiny_export(tmp_path_factory, "llama2", "layer")
    return Generator.open(directory, threads=1), model


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    return Generator.open(bigram_export(tmp_path_factory), threads=1)


FAST = {("llama2", "layer"), ("minicpm4", "model")}
CASES = [pytest.param(p, g, marks=() if (p, g) in FAST else pytest.mark.slow, id=f"{p}-{g}")
         for p in PRESETS for g in ("layer", "model")]


@pytest.mark.parametrize(("preset", "granularity"), CASES)
def test_greedy_tokens_equal_pytorch(tmp_path_factory, preset, granularity):
    directory, model = tiny_export(tmp_path_factory, preset, granularity)
    gen = Generator.open(directory, threads=1)
    ids = prompt(PROMPT_LEN, model.cfg.vocab_size)
    result = gen.complete(ids, GREEDY, StopParams(max_new_tokens=24), ignore_eos=True)
    want = torch_greedy(model, ids, 24)
    assert result.token_ids == want
    assert result.finish_reason == "max_new_tokens"
    assert result.prompt_ids == ids
    # and the numbers behind them, at the last position (a model stuck on one token would pass the above)
    gen.reset()
    got = gen.engine.forward(ids + want[:-1])
    with torch.no_grad():
        expected = model(torch.tensor([ids + want[:-1]]))[0][0, -1].numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 17, 19, 24])
def test_chunked_prefill_logits_match_pytorch(llama, n):
    """Exact chunks, padded last chunks, and a 1-token remainder (17 = 2 x 8 + 1, run by the S=1 graphs)."""
    gen, model = llama
    ids = prompt(n, model.cfg.vocab_size, seed=n)
    gen.reset()
    got = gen.engine.forward(ids).copy()
    assert gen.cache.length == n
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0][0, -1].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # rows past the prompt: the "rows" layout never writes padding; "inplace" graphs write a padded chunk's
    # S rows (masked until overwritten), and nothing past that chunk
    padded = n % 8 > 1  # a 1-token remainder runs through the S = 1 graphs, without padding
    end = -(-n // 8) * 8 if padded and gen.engine.manifest.kv_layout == "inplace" else n
    assert not gen.cache.keys[0][:, :, end:].any()


def test_a_chunk_that_would_run_past_the_cache_goes_token_by_token(tmp_path):
    """max_seq 20, chunk 8, an "inplace" export: a 19-token prompt's third chunk (16 + 8 > 20) would make
    GroupQueryAttention write padding rows past the cache, so those 3 tokens take the S = 1 graphs; the logits
    still match PyTorch and the cache holds exactly the prompt."""
    from edgellm.export import ExportOptions, export_model
    from tests.export_helpers import tiny_model

    model = tiny_model("llama2", seed=3)
    export_model(model, tmp_path / "x", ExportOptions(max_seq=20, prefill_chunk=8), progress=False,
                 log=lambda _: None)
    gen = Generator.open(tmp_path / "x", threads=1)
    assert gen.manifest.kv_layout == "inplace"
    ids = prompt(19, model.cfg.vocab_size, seed=5)
    got = gen.engine.forward(ids).copy()
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0][0, -1].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert gen.cache.length == 19 and not gen.cache.keys[0][:, :, 19:].any()


def test_full_context_finishes_with_length(llama):
    gen, model = llama
    ids = prompt(MAX_SEQ - 4, model.cfg.vocab_size)
    result = gen.complete(ids, GREEDY, StopParams(max_new_tokens=100), ignore_eos=True)
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 5  # 4 rows left: 4 tokens fed back, the 5th picked from the last row
    assert result.token_ids == torch_greedy(model, ids, 5)
    exact = gen.complete(prompt(MAX_SEQ, model.cfg.vocab_size), GREEDY, StopParams(max_new_tokens=9))
    assert (exact.finish_reason, len(exact.token_ids)) == ("length", 1)


def test_prompt_longer_than_the_context(llama):
    gen, model = llama
    ids = prompt(MAX_SEQ + 5, model.cfg.vocab_size)
    with pytest.raises(EdgeError, match="^prompt: .*do not fit the context of 64.*pass `truncate`"):
        gen.complete(ids, GREEDY, StopParams(max_new_tokens=10))
    result = gen.complete(ids, GREEDY, StopParams(max_new_tokens=10), truncate=True)
    assert result.prompt_ids == ids[-(MAX_SEQ - 10):]  # room for the 10 new tokens
    assert result.token_ids == torch_greedy(model, ids[-(MAX_SEQ - 10):], 10)


def test_bad_prompts_are_edge_errors(llama, bigram):
    """The messages name the API's parameters (the CLI prints them as flags: test_cli_run)."""
    gen, _ = llama
    with pytest.raises(EdgeError, match="^prompt_ids: expected at least one"):
        gen.complete([], GREEDY)
    with pytest.raises(EdgeError, match=r"^prompt_ids: token ids must be in \[0, 256\)"):
        gen.complete([3, 256], GREEDY)
    with pytest.raises(EdgeError, match=r"^prompt: .* has no tokenizer; pass token ids \(`prompt_ids`\)"):
        gen.complete("hello", GREEDY)
    with pytest.raises(EdgeError, match="^prompt: expected a non-empty prompt"):
        bigram.complete("", GREEDY)


def test_seeded_sampling_is_reproducible_and_uses_the_right_logits(llama):
    gen, model = llama
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.3)
    ids = prompt(PROMPT_LEN, model.cfg.vocab_size)
    a = gen.complete(ids, params, StopParams(max_new_tokens=16, seed=5), ignore_eos=True).token_ids
    b = gen.complete(ids, params, StopParams(max_new_tokens=16, seed=5), ignore_eos=True).token_ids
    c = gen.complete(ids, params, StopParams(max_new_tokens=16, seed=6), ignore_eos=True).token_ids
    assert a == b != c
    # the same draws from PyTorch's logits: the generator feeds the sampler the right row and history
    rng, want = np.random.default_rng(5), []
    with torch.no_grad():
        for _ in range(16):
            logits = model(torch.tensor([ids + want]))[0][0, -1].numpy()
            want.append(sample(logits, params, rng, ids + want))
    assert a == want


def test_streaming_never_splits_a_character(bigram):
    events = list(bigram.generate("a", GREEDY, StopParams(max_new_tokens=20)))
    result = events[-1]
    assert isinstance(result, Result)
    texts = [e.text for e in events[:-1]]
    # é = c3 a9 and 中 = e4 b8 ad arrive one byte per token: text appears only once a character is whole
    assert texts == ["", "é", "", "", "中", "!"]
    assert all(isinstance(e, TokenEvent) and e.token_id is not None for e in events[:-1])
    assert result.text == CHAIN and result.finish_reason == "eos"
    assert result.prompt_ids == [1, bigram.tokenizer.encode("a")[0]]  # BOS put in front of text
    assert 2 not in result.token_ids and len(result.token_ids) == 6  # EOS ends it and is not returned
    assert bigram.tokenizer.decode(result.token_ids) == CHAIN


def test_the_tokenizer_is_loaded_only_when_text_needs_it(tmp_path_factory):
    """Ids in and ids out never load the tokenizer (its memory is the app's choice); the first text does, once."""
    gen = Generator.open(bigram_export(tmp_path_factory), threads=1)
    assert gen.has_tokenizer and gen._tokenizer is None
    ids = gen.complete([1, 5], GREEDY, StopParams(max_new_tokens=4), text=False).token_ids
    assert gen._tokenizer is None and len(ids) > 0
    result = gen.complete("a", GREEDY, StopParams(max_new_tokens=20))
    assert gen._tokenizer is not None and result.text == CHAIN
    assert gen.tokenizer is gen._tokenizer  # loaded once


LAZY = """
import sys
from edgellm.runtime import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams
gen = Generator.open(sys.argv[1], threads=1)
gen.complete([1, 5], SamplingParams(temperature=0), StopParams(max_new_tokens=4), text=False)
before = "tokenizers" in sys.modules
gen.complete("a", SamplingParams(temperature=0), StopParams(max_new_tokens=4))
print(before, "tokenizers" in sys.modules)
"""


def test_ids_only_runs_never_import_the_tokenizer_library(tmp_path_factory):
    """In a fresh interpreter: `tokenizers` (~9 MB resident) is imported by the first text, not by ids."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", LAZY, str(bigram_export(tmp_path_factory))], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]


@pytest.mark.parametrize(("stops", "text", "deltas"), [
    (("中",), "é", ["", "é", "", "", ""]),
    (("é中",), "", ["", "", "", "", ""]),
    (("中?",), CHAIN, ["", "é", "", "", "", "中!"]),  # "中" is held back until it cannot start "中?"
    (("x",), CHAIN, ["", "é", "", "", "中", "!"]),
])
def test_stop_strings(bigram, stops, text, deltas):
    events = list(bigram.generate("a", GREEDY, StopParams(max_new_tokens=20, stop=stops)))
    result = events[-1]
    assert result.text == text == "".join(e.text for e in events[:-1])
    assert [e.text for e in events[:-1]] == deltas
    assert result.finish_reason == ("eos" if text == CHAIN else "stop")


def test_ignore_eos_and_max_new_tokens(bigram):
    result = bigram.complete("a", GREEDY, StopParams(max_new_tokens=9), ignore_eos=True)
    assert (result.finish_reason, len(result.token_ids), result.token_ids[6]) == ("max_new_tokens", 9, 2)
    empty = bigram.complete("a", GREEDY, StopParams(max_new_tokens=0))
    assert (empty.finish_reason, empty.token_ids, empty.text) == ("max_new_tokens", [], "")


def test_kept_context_equals_one_long_prompt(llama):
    gen, model = llama
    first, second = prompt(10, 256, seed=1), prompt(6, 256, seed=2)
    one = gen.complete(first, GREEDY, StopParams(max_new_tokens=5), ignore_eos=True)
    two = gen.complete(second, GREEDY, StopParams(max_new_tokens=5), ignore_eos=True, keep_context=True)
    assert two.prompt_ids == one.token_ids[-1:] + second  # the last pick was never fed: it goes first
    assert two.token_ids == torch_greedy(model, first + one.token_ids + second, 5)
    assert gen.context_tokens == 10 + 5 + 6 + 5
    # a prompt that does not fit what is left starts a new context
    big = prompt(40, 256, seed=3)
    three = gen.complete(big, GREEDY, StopParams(max_new_tokens=3), ignore_eos=True, keep_context=True)
    assert three.prompt_ids == big and three.token_ids == torch_greedy(model, big, 3)


def test_timings_and_memory_are_reported(llama):
    gen, model = llama
    t = gen.complete(prompt(PROMPT_LEN, 256), GREEDY, StopParams(max_new_tokens=12), ignore_eos=True)
    s = t.timings
    assert (s.prompt_tokens, s.new_tokens) == (PROMPT_LEN, 12)
    assert s.ttft_s > 0 and s.prefill_tok_s == pytest.approx(PROMPT_LEN / s.ttft_s)
    assert 0 < s.decode_run_s < s.decode_s and s.decode_tok_s == pytest.approx(11 / s.decode_s)
    assert 0 <= s.overhead_pct < 100 and t.peak_rss_mb > 10
    assert set(t.to_dict()) == {"text", "token_ids", "finish_reason", "stats"}


def test_weights_are_held_once(llama):
    """Layer graphs (`stack=False`, as `edgellm diff` runs them): decode graphs pre-pack (onnxruntime's own
    copy); prefill graphs read the shared maps in place and release their pages after each run. The stack
    (the default path) pre-packs every layer once for both variants and reads only the embedding table from a
    map. Every shared initializer is a view of a map, not a copy."""
    from edgellm.runtime.session import SessionConfig

    gen, _ = llama
    layered = Generator.open(gen.directory, config=SessionConfig(threads=1, stack=False))
    where = layered.engine.placement
    assert set(where) == {g.name for g in gen.manifest.graphs if g.role not in ("stack", "stack_lone")}
    for g in gen.manifest.graphs:
        if g.role not in ("stack", "stack_lone"):
            # untied: nothing else reads the decode weights; a paired graph (the head, format 9) is one session
            assert where[g.name].prepack == (g.seq == 1 or g.paired), g.name
        if g.seq > 1 and g.role == "layer":  # its weights and the layers' one copy of the RoPE tables
            assert where[g.name].release == (g.data, "rope.data")
    weights = layered.engine.weights
    assert sorted(weights._maps) == sorted({g.data for g in gen.manifest.graphs if g.seq > 1 and g.role == "layer"}
                                           | {"embed.data", "rope.data"})
    for engine in (layered.engine, gen.engine):
        for value in engine.weights._values.values():
            assert value.numpy().base is not None  # a view, not a copy
    where, stack = gen.engine.placement, gen.engine.stack_role   # the lone-row stack until speculation is on
    assert set(where) == {f"{stack}.prefill", f"{stack}.decode", "head.prefill", "head.decode"}
    assert where[f"{stack}.decode"].prepack and where[f"{stack}.decode"].tables == ("embed.data",)
    assert sorted(gen.engine.weights._maps) == ["embed.data"]


def test_the_head_is_opened_first_and_once(llama, monkeypatch):
    """Engine opens the (paired) head before any other graph, so pre-packing the largest weight peaks on an
    empty heap (engine.py); its one session still serves both variants, and no graph file is opened twice."""
    import edgellm.runtime.engine as engine_module
    from edgellm.runtime.session import SessionConfig

    gen, _ = llama
    real = engine_module.open_placed
    for stack in (True, False):
        opened: list[str] = []

        def spy(path, spec, where, config, weights, opened=opened):
            opened.append(spec.file)
            return real(path, spec, where, config, weights)

        monkeypatch.setattr(engine_module, "open_placed", spy)
        other = Generator.open(gen.directory, config=SessionConfig(threads=1, stack=stack))
        assert opened[0] == gen.manifest.graph("head", 1).file and len(opened) == len(set(opened)), opened
        ids = prompt(PROMPT_LEN, gen.manifest.vocab_size)
        assert other.complete(ids, GREEDY, StopParams(max_new_tokens=6), text=False).token_ids == \
            gen.complete(ids, GREEDY, StopParams(max_new_tokens=6), text=False).token_ids


@pytest.mark.slow
def test_a_tied_table_is_packed_by_the_head_and_gathered_from_the_map(tmp_path_factory):
    """The head pre-packs even a tied table (its S > 1 rows then sum as its S = 1 row does: placement.py); the
    embedding (or stack) gathers rows from the shared map, released every few steps like any lookup table."""
    from edgellm.runtime.session import SessionConfig

    directory, model = tiny_export(tmp_path_factory, "qwen2", "layer")
    for stack in (True, False):
        engine = Generator.open(directory, config=SessionConfig(threads=1, stack=stack)).engine
        where = engine.placement
        assert where["head.decode"].prepack and not where["head.decode"].mapped
        gatherer = where[f"{engine.stack_role}.decode" if stack else "embed.decode"]
        assert "head.data" in gatherer.tables and gatherer.mapped == gatherer.info.gathered
    # rope.data, read by every layer, holds no weight: the layers still pre-pack their own
    assert where["layer_0.decode"].prepack and where["layer_0.prefill"].release == ("layer_0.data", "rope.data")


def test_graph_info_reader_agrees_with_onnx(llama):
    """runtime.onnxmeta parses the protobuf by hand (no onnx on the board): compare it with onnx itself."""
    import onnx

    from edgellm.runtime.onnxmeta import read_graph_info

    gen, _ = llama
    for spec in gen.manifest.graphs:
        path = gen.directory / spec.file
        model = onnx.load(str(path), load_external_data=False)
        want = [(t.name, tuple(t.dims), t.data_type, {e.key: e.value for e in t.external_data})
                for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        info = read_graph_info(path)
        got = [(t.name, t.shape, t.data_type, {"location": t.location, "offset": str(t.offset),
                                               "length": str(t.length)}) for t in info.external]
        assert got == want and got
        assert info.op_types == {n.op_type for n in model.graph.node}
        tables = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
        others = {i for n in model.graph.node for i in n.input[n.op_type == "Gather":]}
        assert info.gathered == tables - others, spec.name
        assert (spec.role not in ("embed", "stack", "stack_lone")) == (not info.gathered), spec.name


SHARED_POOL = """
import json, sys
from edgellm.runtime import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.session import SessionConfig
if sys.argv[2] == "foreign":  # other code made onnxruntime's global pool first: our sessions must join it
    from onnxruntime.capi import _pybind_state
    _pybind_state.set_global_thread_pool_sizes(1, 1)
    config = SessionConfig(threads=1)
else:
    config = SessionConfig(threads=1, shared_pool=True)
gen = Generator.open(sys.argv[1], config=config)
r = gen.complete(list(range(1, 20)), SamplingParams(temperature=0), StopParams(12), ignore_eos=True)
print(json.dumps(r.token_ids))
"""


@pytest.mark.parametrize("who", ["ours", "foreign"])
def test_shared_thread_pool_gives_the_same_tokens(llama, who):
    """In a subprocess: onnxruntime's global pool is process-wide and would leak into the other tests."""
    import json
    import subprocess
    import sys

    gen, _ = llama
    want = gen.complete(list(range(1, 20)), GREEDY, StopParams(12), ignore_eos=True).token_ids
    proc = subprocess.run([sys.executable, "-c", SHARED_POOL, str(gen.directory), who], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == want
