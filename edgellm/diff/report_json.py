"""report.json: every number of a diff, versioned ({"schema": "edgellm-diff", "version": 1, ...}).

Version 1 layout (keys of the top-level object):
  schema, version, edgellm_version, created (UTC ISO-8601), checkpoint {path, source},
  text {source: "file"|"generated", path + tokenizer | seed, n_tokens, start_id (BOS; EOS for BOS-less
  models when generated; null for a file whose tokenizer adds no BOS, as `edgellm run` tokenizes), tokens [T]},
  settings {text, generated, tokens, prompts, prompt_len, continuation, seed, jump_factor, jump_floor,
  fail_if, verify_sha, threads},
  reference {ppl: {max_seq: ppl}}, variants [...], gate {conditions, failed [...], passed} | null, seconds.
  Each variant: name, path, granularity, max_seq, prefill_chunk, precision ("fp32", "int4 g32 sym rtn"),
  quantization (the manifest's record without its per-weight table, null for fp32), per_layer {available,
  note, embed, layers [{layer, hidden, key, value, error}], first_drift_layer, largest_jump_layer,
  worst_rel_rms}, logits {n_positions, kl {mean, std, min, median, p90, p95, p99, max}, kl_per_position,
  top1, top5, dp {mean, rms, worst}, max_abs_logit}, ppl {ppl, ref_ppl, delta, delta_rel},
  greedy {prompts [{start, prompt_len, reference, export, agree, + prompt_text, reference_text, export_text
  when a tokenizer is at hand}], agreed, total, agreement, identical},
  seconds. Tensor errors are {cosine, max_abs, rel_rms, snr_db}.
  verdict (added by writer.write_report; absent from reports written before it existed): bar {conditions
  ["kl>0.05", ...] (failure conditions, as --fail-if), source "--fail-if"|"default"}, variants [{name, bytes,
  passes, failed ["kl>0.05 (0.12)"], kl, top1, quantized, size_vs_fp32}], ship {name, bytes, size_vs_fp32} |
  null (the smallest variant passing the bar), error {variant, layers [{layer, growth, error, worst_weight?,
  weight_rel_rms_err?}]} | null, fix {variant, argv, command, output, layers, pasteable} | null (an
  `edgellm quantize` command), text (the paragraph shown in report.html and the terminal).
Numbers that are not finite are written as the strings "inf", "-inf", "nan" (JSON has no such numbers);
`load_report` turns them back into floats.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from edgellm.runtime.errors import EdgeError, need

SCHEMA = "edgellm-diff"
VERSION = 1
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _encode(value: Any) -> Any:
    """Replace non-finite floats by strings, recursively (numpy scalars arrive here as Python floats)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def dumps_report(report: dict[str, Any]) -> str:
    """The report as JSON text (schema and version first)."""
    doc = {"schema": SCHEMA, "version": VERSION, **{k: v for k, v in report.items() if k not in ("schema", "version")}}
    return json.dumps(_encode(doc), indent=1, allow_nan=False) + "\n"


def load_report(path: Path) -> dict[str, Any]:
    """Read a report.json; EdgeError for a file that is not one or has a version this edgellm cannot read."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise EdgeError(f"{path}: cannot read a diff report ({err})") from None
    need(isinstance(doc, dict) and doc.get("schema") == SCHEMA,
         f"{path}: not an edgellm diff report (expected schema {SCHEMA!r})")
    need(doc.get("version") == VERSION,
         f"{path}: diff report version {doc.get('version')!r} is not supported (this edgellm reads {VERSION})")
    return _decode(doc)
