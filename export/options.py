"""`ExportOptions`: what `edgellm export` was asked to build, checked against the model before any work."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from edgellm.model import ModelConfig
from edgellm.runtime.errors import need
from edgellm.runtime.graphio import FP16_CACHE_ATOL, SLIDING_CACHES, ring_layers
from edgellm.runtime.manifest import Granularity

Attention = Literal["fused", "standard"]
GRANULARITIES: tuple[Granularity, ...] = get_args(Granularity)
ATTENTIONS: tuple[Attention, ...] = get_args(Attention)
# The dynamo exporter emits opset 18+; onnxruntime 1.22 (the oldest the board install allows) runs up to 21.
OPSETS = range(18, 22)


EXPORT_KV_DTYPES = ("float32", "float16")  # graphio.KV_DTYPES but int8, which quantize makes (calibrated scales)

@dataclass(frozen=True)
class ExportOptions:
    max_seq: int = 512         # static context: the KV-cache buffers are [1, n_kv, max_seq, hd]
    prefill_chunk: int = 32    # S of the prefill graphs (decode graphs have S = 1)
    granularity: Granularity = "layer"  # "layer": embed + one graph per layer + head; "model": one graph
    # "fused": layers hand-built from onnxruntime's fused kernels (GroupQueryAttention, ...; export/fused.py);
    # "standard": traced standard ONNX ops only, for toolchains without com.microsoft ops. The model graph
    # (granularity "model") is always traced.
    attention: Attention = "fused"
    atol: float = 1e-4         # max |onnxruntime - PyTorch| / max(1, max |PyTorch|) on any graph output
    opset: int = 20
    seed: int = 0              # of the verification inputs
    kv_dtype: str = "float32"  # the cache's element type (graphio.KV_DTYPES): float16 halves its bytes (fused only)
    # sliding-window layers' caches (graphio.SLIDING_CACHES): rings where they hold fewer rows than max_seq, or
    # full-length caches attended by GroupQueryAttention (faster; the cache as long as a full layer's)
    sliding_cache: str = "ring"

    def validate(self, cfg: ModelConfig | None = None) -> None:
        """EdgeError naming the flag at fault; with `cfg`, also the limits the model sets."""
        need(isinstance(self.max_seq, int) and self.max_seq >= 2,
             f"--max-seq: expected an integer >= 2, got {self.max_seq!r}")
        need(isinstance(self.prefill_chunk, int) and self.prefill_chunk >= 1,
             f"--prefill-chunk: expected an integer >= 1, got {self.prefill_chunk!r}")
        need(self.prefill_chunk <= self.max_seq,
             f"--prefill-chunk {self.prefill_chunk} is larger than --max-seq {self.max_seq}")
        need(self.granularity in GRANULARITIES,
             f"--granularity: expected one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        need(self.attention in ATTENTIONS,
             f"--attention: expected one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        need(isinstance(self.atol, (int, float)) and 0 < self.atol < float("inf"),
             f"--atol: expected a positive number, got {self.atol!r}")
        need(self.opset in OPSETS, f"--opset: expected {OPSETS.start}..{OPSETS.stop - 1}, got {self.opset!r}")
        need(self.kv_dtype in EXPORT_KV_DTYPES,
             f"--kv-dtype: expected one of {', '.join(EXPORT_KV_DTYPES)}, got {self.kv_dtype!r}"
             + (" (an int8 cache's scales are calibrated: `edgellm quantize --kv-dtype int8`)"
                if self.kv_dtype == "int8" else ""))
        need(self.kv_dtype == "float32" or self.kv_layout == "inplace",
             f"--kv-dtype {self.kv_dtype}: written by the fused layers only (--attention fused, --granularity layer)")
        need(self.sliding_cache in SLIDING_CACHES,
             f"--sliding-cache: expected one of {', '.join(SLIDING_CACHES)}, got {self.sliding_cache!r}")
        need(self.sliding_cache == "ring" or self.kv_layout == "inplace",
             f"--sliding-cache {self.sliding_cache}: written by the fused layers only (--attention fused, "
             "--granularity layer)")
        if cfg is not None:
            need(self.max_seq <= cfg.max_seq_len,
                 f"--max-seq {self.max_seq} exceeds the model's max_seq_len {cfg.max_seq_len}")
            rings = any(ring_layers(cfg.to_dict(), self.max_seq, sliding_cache=self.sliding_cache))
            need(self.kv_dtype == "float32" or not rings,
                 f"--kv-dtype {self.kv_dtype}: sliding-window layers shorter than --max-seq (their ring caches attend "
                 "in standard ops) keep float32 caches; export this model with --kv-dtype float32 or "
                 "--sliding-cache full")

    @property
    def tolerance(self) -> float:
        """The verification's bound on every graph and end to end: --atol, and at least FP16_CACHE_ATOL with an
        fp16 cache (the errors then print it as the --atol in force)."""
        return self.atol if self.kv_dtype == "float32" else max(self.atol, FP16_CACHE_ATOL)

    @property
    def kv_layout(self) -> str:
        """The cache layout the graphs use (runtime/kvcache.py): fused layers write the cache in place."""
        return "inplace" if self.attention == "fused" and self.granularity == "layer" else "rows"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
