"""onnxruntime sessions for an export directory: options for a small-RAM board, one copy of the weights,
and graphs whose inputs and outputs are bound once to caller-owned numpy buffers.

Choices (the measurements behind them: docs/benchmarks.md, "Runtime design measurements"):
- Weights: onnxruntime maps page-aligned external data lazily, but each session maps the file itself (RSS
  counts every mapping) and MatMul pre-packing makes a private copy per session, so a prefill and a decode
  session held a layer twice. `SharedWeights` maps each data file once and hands its initializers to
  sessions as views (`SessionOptions.add_initializer` uses the memory in place; `add_external_initializers`
  and the in-memory-file option copy it). Which graphs
  read the maps and which pre-pack their own copy is `placement.plan`'s decision.
- Threads: by default every session owns an intra-op pool. A pool that spins after its Run competes for the
  cores with the next graph's pool (layer granularity runs N + 2 graphs per token), so spinning is off.
  `shared_pool` (threadpool.py) is the fast option.
- Arena: onnxruntime's CPU arena keeps each session's largest intermediates (the prefill chunk's) for good,
  so it is off.
- IOBinding: inputs/outputs are bound once and run with `run_with_iobinding` (a third of `run(dict)`'s cost
  per call); onnxruntime writes outputs straight into the bound buffers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Literal

import numpy as np
import onnxruntime as ort

from .errors import EdgeError, need
from .manifest import GraphSpec
from .placement import Placement
from .threadpool import ensure_shared_pool, needs_global_pool
from .weightmap import SharedWeights, released_while

MAX_THREADS = 256


@dataclass(frozen=True)
class SessionConfig:
    """How sessions are built. The defaults are the low-memory choice described above."""

    threads: int | None = None       # intra-op threads per session; None => onnxruntime's default
    shared_pool: bool = False        # one process-wide thread pool for all sessions (see threadpool.py)
    # pre-pack the prefill graphs' weights (faster prefill, +1 copy in RAM); None: quantized graphs only
    prepack_prefill: bool | None = None
    spinning: bool = False           # let idle pool threads spin (faster only when nothing else runs)
    arena: bool = False              # onnxruntime's CPU arena for intermediate tensors
    optimization: Literal["disable", "basic", "extended", "all"] = "all"  # graph optimisation level
    stack: bool = True               # run an export's stack graph when it has one (else embed + layers)
    # True: each decode step computes its row as a speculative verification does (the stack's spare attention
    # row): greedy speculation then keeps plain decoding's tokens. False: the lone-row stack where the export has
    # one (format 13, edgellm/layout/lone.py), 8-27 % faster decode, for sampling (rejection sampling needs no
    # bitwise rows) and plain decoding. None (the default): the lone-row stack until speculation is set up
    # (`Generator.speculate` then reopens the engine on the spare-row stack): an app that decodes plainly does
    # not pay for a row only speculation needs
    exact: bool | None = None
    # which stack graph to open, whatever `exact` and the cache type would pick (variant.stack_role): the checks
    # that compare the two stacks of one export (edgellm/layout/stacking.check_lone); "auto" everywhere else
    stack_graph: Literal["auto", "stack", "stack_lone"] = "auto"
    entries: tuple[tuple[str, str], ...] = ()  # more session config entries (tests: the QDQ accuracy level)

    def validate(self) -> None:
        # each session gets its own pool of `threads`: an absurd count would start that many OS threads N + 2
        # times over (a fuzzed --threads 100000 loaded the machine for minutes)
        need(self.threads is None or (isinstance(self.threads, int) and 1 <= self.threads <= MAX_THREADS),
             f"threads: expected an integer in 1..{MAX_THREADS}, got {self.threads!r}")
        need(self.prepack_prefill in (None, True, False),
             f"prepack_prefill: expected true, false or null, got {self.prepack_prefill!r}")
        need(self.optimization in _LEVELS,
             f"graph optimisation: expected one of {', '.join(_LEVELS)}, got {self.optimization!r}")
        need(self.exact in (None, True, False), f"exact: expected true, false or null, got {self.exact!r}")
        need(self.stack_graph in ("auto", "stack", "stack_lone"),
             f"stack_graph: expected auto, stack or stack_lone, got {self.stack_graph!r}")


_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def session_options(config: SessionConfig, prepack: bool) -> ort.SessionOptions:
    so = ort.SessionOptions()
    if config.shared_pool and ensure_shared_pool(config.threads):
        so.use_per_session_threads = False  # no thread counts then: onnxruntime warns they are ignored
    else:
        if config.threads is not None:
            so.intra_op_num_threads = config.threads
        so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = _LEVELS[config.optimization]
    so.enable_cpu_mem_arena = config.arena
    so.log_severity_level = 4  # fatal only: warnings are not the user's business, errors come back as EdgeError
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spinning else "0")
    so.add_session_config_entry("session.disable_prepacking", "0" if prepack else "1")
    for key, value in config.entries:
        so.add_session_config_entry(key, value)
    return so


def open_session(path: Path, options: ort.SessionOptions) -> ort.InferenceSession:
    try:
        try:
            return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as err:
            if not needs_global_pool(err) or not options.use_per_session_threads:
                raise
            options.use_per_session_threads = False  # other code made a global pool: every session must use it
            return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime raises its own exception types, all Exceptions
        message = " ".join(str(err).split())
        hint = ""
        if "MatMulNBits" in message and "Only 4b" in message:  # onnxruntime < 1.22 has 4-bit MatMulNBits only
            hint = f"; int8 `fast` exports need onnxruntime >= 1.22, this is {ort.__version__}"
        raise EdgeError(f"{path}: onnxruntime cannot load this graph ({message[:300]}){hint}") from None


class RunClock:
    """Seconds spent inside onnxruntime's Run calls (the rest of a step is the runtime's own overhead)."""

    __slots__ = ("seconds", "calls")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0


class BoundGraph:
    """A session whose inputs and outputs are bound once to numpy buffers the caller owns and updates in
    place; `run` then passes no data through Python at all."""

    def __init__(self, session: ort.InferenceSession, inputs: dict[str, np.ndarray],
                 outputs: dict[str, np.ndarray], clock: RunClock, where: str) -> None:
        want_in = {i.name for i in session.get_inputs()}
        want_out = {o.name for o in session.get_outputs()}
        need(want_in == set(inputs), f"{where}: graph inputs {sorted(want_in)}, expected {sorted(inputs)}")
        need(want_out == set(outputs), f"{where}: graph outputs {sorted(want_out)}, expected {sorted(outputs)}")
        self.session, self.clock, self.where = session, clock, where
        self.inputs, self.outputs = inputs, outputs  # keep the memory the binding points into alive
        self.binding = session.io_binding()
        for name, array in inputs.items():
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(_checked(array, where)))
        for name, array in outputs.items():
            self.binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(_checked(array, where)))
        self._run = session.run_with_iobinding

    def run(self) -> None:
        start = perf_counter()
        try:
            self._run(self.binding)
        except Exception as err:
            raise EdgeError(f"{self.where}: onnxruntime failed ({' '.join(str(err).split())[:300]})") from None
        self.clock.seconds += perf_counter() - start
        self.clock.calls += 1


def _checked(array: np.ndarray, where: str) -> np.ndarray:
    need(array.flags.c_contiguous and array.flags.writeable, f"{where}: bound buffers must be writable C arrays")
    return array


_ORT_DTYPES = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(float16)": "float16",
               "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(int8)": "int8"}
# the first onnxruntime whose CPU GroupQueryAttention runs an int8 cache with packed qkv (1.25-1.26 load the graph
# and fail in the first run; checked 2026-11-27 on 1.24.4, 1.25.0, 1.25.1, 1.26.0, 1.27.0, 1.28.0, 1.30.0, 1.32.0)
KV_INT8_ORT = (1, 27)


def check_onnxruntime(manifest_kv_dtype: str, where: str) -> None:
    """Refuse, in one line, an export this onnxruntime cannot run (before any session is made)."""
    found = tuple(int(x) for x in re.findall(r"\d+", ort.__version__)[:2])
    need(manifest_kv_dtype != "int8" or found >= KV_INT8_ORT,
         f"{where}: its int8 KV cache needs onnxruntime >= {'.'.join(map(str, KV_INT8_ORT))}, this is "
         f"{ort.__version__} (pip install -U onnxruntime, or quantize the fp32 export again without --kv-dtype int8)")


def check_io(session: ort.InferenceSession, spec: GraphSpec) -> None:
    """The graph's declared inputs/outputs are exactly the manifest's (names, static shapes, dtypes): a graph
    that disagrees is refused at load time, naming the file, rather than failing mid-generation. A paired
    graph serves both S: its symbolic dims (the hidden states' S) match the variant's size."""
    for kind, got, want in (("input", session.get_inputs(), spec.inputs), ("output", session.get_outputs(),
                                                                            spec.outputs)):
        declared = {a.name: (tuple(a.shape), _ORT_DTYPES.get(a.type, a.type)) for a in got}
        for t in want:
            need(t.name in declared, f"{spec.file}: has no {kind} {t.name!r} (the manifest lists it)")
            if spec.paired and len(declared[t.name][0]) == len(t.shape):
                shape = tuple(w if isinstance(d, str) else d for d, w in zip(declared[t.name][0], t.shape, strict=True))
                declared[t.name] = (shape, declared[t.name][1])
            need(declared[t.name] == (tuple(t.shape), t.dtype),
                 f"{spec.file}: {kind} {t.name!r} is {declared[t.name][1]}{list(declared[t.name][0])}, "
                 f"the manifest says {t.dtype}{list(t.shape)}")
        need(len(declared) == len(want), f"{spec.file}: declares {len(declared)} {kind}s, the manifest {len(want)}")


def open_placed(path: Path, spec: GraphSpec, where: Placement, config: SessionConfig,
                weights: SharedWeights) -> ort.InferenceSession:
    """Open a graph as its `Placement` says (pre-packed, or reading the shared weight maps) and check its
    declared I/O against the manifest: the one way the runtime, and the diff that mirrors it, open graphs."""
    options = session_options(config, where.prepack)
    weights.add_to(options, path, where.info, where.mapped)
    with released_while(weights, where.packed_files):
        session = open_session(path, options)
    weights.drop_cached_tables()
    check_io(session, spec)
    return session
