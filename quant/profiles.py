"""`edgellm quantize --profile`: the settings of the flags a user did not give, chosen on real checkpoints against
llama.cpp (bench/quant_vs_llamacpp.py, docs/quantization.md).

Two sets per profile: one for float weights (a trained or bf16 checkpoint), and, where `--block-min auto` finds
every linear already on a llama.cpp grid (a model converted from a GGUF, grids.py), the fields it replaces then
(`ON_GRIDS`). A flag the user gave wins over both.

--bits 4 (SmolLM2-135M-Instruct moved off its grid, KL against transformers fp32, llama.cpp in the same run):
- `balanced` (default), llama.cpp Q4_K_M's class: AWQ's scale migration, then block minima by llama.cpp's k-quant
  search weighted by calibration activations (methods.search_offsets; the offsets' term an 8-bit MatMulNBits), fp16
  scales, every row of the table int8 and the 15 % most sensitive linears int8 (mixed.py): KL 0.0855 at 105.0 MB vs
  Q4_K_M 0.0884 at 105.5 (the k-quant search without AWQ's migration 0.0905; AVX2 EPYC, 2026-11-27 22:05). Three
  more nodes per linear: ~0.8x `small`'s decode.
- `small`, llama.cpp Q4_0's class: AWQ on symmetric blocks, 10 % of the table's rows int8 (headsplit.py): KL 0.213
  at 87.2 MB vs Q4_0 0.349 at 91.7 (Gemma 3 270M off its grid 0.145 at 182.0 vs Q4_0 0.294 at 241.4). 30 % of the
  rows (the setting until 2026-11-28) gave 0.198 at 89.7 / 0.135 at 196.7, but a head of 151936 rows then holds
  +13 MB more int8 bytes than at 10 %, read every step: Qwen2.5-0.5B shape decode 0.94x onnxruntime-genai (int4
  head) at 30 %, 0.99x at 10 %, 1.01x with an int4 head (whose KL on Gemma is 0.237: too close to Q4_0's).
- On grids (both): the linears kept exactly (method "grid"), no int8 fraction (a kept grid holds nothing more to
  recover). `balanced`: 45 % of the table's rows int8 (its int4 rows are most of the error left: Gemma 3 270M KL
  0.0110 -> 0.0031 for +11 MB), float32 scales (released once packed: less peak RSS). `small`: float16 scales (with
  float32 ones it was the default's size, above Q4_0's: SmolLM2 on its Q4_1 grid 105.0 MB vs Q4_0 91.7) and its
  10 % of the table's rows, as on float weights: against 45 % (bench/quant_vs_llamacpp.py 'int4 small rows10',
  2026-11-28 14:34-14:41) SmolLM2 KL 0.0308 at 86.1 MB (45 %: 0.0171 at 91.0; Q4_0 0.3717 at 91.7), decode 1.05x;
  Gemma 3 0.0221 at 211.3 MB (0.0029 at 240.6; Q4_0 0.3618 at 241.4), decode 1.08x, peak RSS 381 vs 408 MB.
--bits 8: AWQ's clip search on float weights (SmolLM2 off its grid 0.0055 vs Q8_0 0.0059 at 22:05); on a grid
rounded to nearest, which keeps Q8_0 / Q5_0 tensors exactly (Gemma 3: 0.0031 vs AWQ 0.0033, Q8_0 0.0032).
"""

from __future__ import annotations

from typing import Any

from edgellm.runtime.errors import need

PROFILES: dict[str, dict[int, dict[str, Any]]] = {
    "balanced": {4: {"method": "awq", "block_min": "on", "scales_dtype": "float16", "lm_head": "int8",
                     "head_int8_rows": 1.0, "int8_fraction": 0.15, "kv_dtype": "auto"},
                 8: {"method": "awq", "block_min": "off", "scales_dtype": "auto", "lm_head": None,
                     "head_int8_rows": 1.0, "int8_fraction": 0.0, "kv_dtype": "auto"}},
    "small": {4: {"method": "awq", "block_min": "off", "scales_dtype": "auto", "lm_head": "int8",
                  "head_int8_rows": 0.1, "int8_fraction": 0.0, "kv_dtype": "auto"}},
}
_GRIDS_4 = {"head_int8_rows": 0.45, "int8_fraction": 0.0, "scales_dtype": "auto"}
ON_GRIDS: dict[str, dict[int, dict[str, Any]]] = {
    "balanced": {4: _GRIDS_4, 8: {"method": "rtn"}},
    "small": {4: {"int8_fraction": 0.0, "scales_dtype": "float16"}},   # Q4_0's class, the faster: the table's 10 %
}
GRID_FIELDS = frozenset(k for p in ON_GRIDS.values() for d in p.values() for k in d)  # QuantizeOptions.on_grids's
OFFSET_METHODS = ("mse", "awq")   # the methods that search block offsets (rtn takes min..max, gptq none)


def defaults(bits: int, profile: str, given: dict[str, Any], format: str, symmetric: bool,
             group_size: int | None) -> tuple[dict[str, Any], tuple[tuple[str, Any], ...]]:
    """(every field of PROFILES with `given`'s values winning, the on-grid replacements of fields not given).

    A profile's block minima need what they are made of (fast format, symmetric codes, blocks) and a method that
    searches offsets: without, its linears are symmetric blocks (by the profile's AWQ unless --method was given).
    A head that cannot be split (int4 / fp32, or portable) has every row of its precision."""
    need(profile in PROFILES, f"--profile: expected {' or '.join(PROFILES)}, got {profile!r}")
    need(bits in PROFILES[profile], f"--profile {profile}: only with --bits "
                                    f"{' or '.join(map(str, PROFILES[profile]))}, got --bits {bits}")
    out = {**PROFILES[profile][bits], **given}
    offsets_fit = (format == "fast" and symmetric and group_size != 0 and out["method"] in OFFSET_METHODS)
    if "block_min" not in given and not offsets_fit:
        out["block_min"] = "off"
    splittable = out["lm_head"] == "int8" and format == "fast"
    if "head_int8_rows" not in given and not splittable:
        out["head_int8_rows"] = 1.0
    grids = {k: v for k, v in ON_GRIDS[profile].get(bits, {}).items()
             if k not in given and (k != "head_int8_rows" or splittable)}
    return out, tuple(sorted(grids.items()))
