"""The buffers of one sequence length S that an Engine binds its graphs to (`Variant`), what a `forward_rows`
hook sees after each graph (`GraphRun`), and whether an Engine runs the stack graph (`runs_stack`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import need
from .manifest import GraphSpec, Manifest
from .session import BoundGraph, SessionConfig


@dataclass(frozen=True)
class GraphRun:
    """What a `forward_rows` hook sees right after one graph ran. The arrays are the Engine's bound buffers
    (views: the next run overwrites them; copy what you keep): rows [0, count) of each [1, S, ...] input and
    output are real, the rest padding. Layer and model graphs of kv_layout "rows" return only the S new K/V
    rows (present_*), written to the cache after the step's last graph; "inplace" present_* are the cache
    buffers themselves, already written."""

    spec: GraphSpec                 # which graph (role, layer, seq)
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    start: int                      # the cache length before this call: the position of its first row
    count: int                      # real rows (<= spec.seq)


Hook = Callable[[GraphRun], None]


def runs_stack(manifest: Manifest, config: SessionConfig) -> bool:
    """Whether an Engine runs the export's stack graph (edgellm/layout/stacking.py) rather than embed + layers."""
    return manifest.granularity == "layer" and manifest.has_stack and config.stack


# cache types whose attention computes a lone row (S = 1) bit for bit as that row among several: onnxruntime's
# quantized-cache GroupQueryAttention runs one routine for every S (measured: SmolLM2-135M-Instruct int4 with an
# int8 cache, each S = 1 decode step = its row of S = 5..16 verifications, 40-700 rows of context; fp32 and fp16
# caches compute a lone row in another order: up to 0.66 off in the logits). Their lone-row stack is exact.
LONE_EXACT = ("int8",)


def stack_role(manifest: Manifest, config: SessionConfig) -> str:
    """Which stack an Engine that runs one opens: "stack_lone" (no spare attention row, format 13;
    edgellm/layout/lone.py) when the export has it and `config.exact` is not True or the cache type makes it exact
    (LONE_EXACT: its rows are then the stack's, bit for bit, without the spare row's cost), else "stack";
    `config.stack_graph` other than "auto" names the one to open."""
    if config.stack_graph != "auto":
        need(config.stack_graph == "stack" or manifest.has_lone_stack,
             "stack_graph: stack_lone asked for, but the export has no lone-row stack (manifest format 13)")
        return config.stack_graph
    lone_ok = config.exact is not True or manifest.kv_dtype in LONE_EXACT
    return "stack_lone" if lone_ok and manifest.has_lone_stack else "stack"


class Variant:
    """Buffers and bound graphs for one sequence length S."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.tokens = np.zeros((1, seq), np.int64)
        self.positions = np.zeros((1, seq), np.int64)
        # present rows [1, n_kv, S, hd], one pair per layer, copied into the cache after the whole step:
        # the copies then run back to back with warm caches (one right after each layer's run cost ~20 us
        # each, against ~2 us in a row, on the dev VM)
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.graphs: list[BoundGraph] = []
        self.specs: list[GraphSpec] = []  # graphs[i]'s manifest entry
        self.logits: np.ndarray | None = None      # [1, S, V]; layer granularity: S = 1 only
        self.hidden_out: np.ndarray | None = None  # the last layer's output (layer granularity)
        self.body: list[BoundGraph] = []  # what a chunk runs: embed + layers (the head runs once, last), or model
        self.release: list[tuple[str, ...]] = []  # per body graph: data files to release after its run
        self.releases = False  # whether any body graph releases anything (decided once, not per step)

    def add_present(self, n: int, manifest: Manifest) -> None:
        shape = (1, manifest.n_kv_heads, self.seq, manifest.head_dim)
        for _ in range(n):
            self.keys.append(np.zeros(shape, np.float32))
            self.values.append(np.zeros(shape, np.float32))
