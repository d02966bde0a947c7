"""Host half of bench/arm64_check.sh: tiny exports (fp32, int8, int4, int4kv8 with an int8 KV cache, int4min with
block minima, int4grid: a model on a Q4_K_M-like mix of grids, each kept, and fp32 with an fp16 KV cache: kv16) and their greedy outputs on this machine (int4 also through its lone-row stack,
`--exact-decode off`; int4kv8 also with speculation off, so the board's speculative tokens are checked against its
plain ones).

    python bench/arm64_host.py prepare WORK     # WORK/exports/{fp32,...,int4min,int4grid}, WORK/host/<name>.json
    python bench/arm64_host.py shim WORK REPO   # WORK/shim/edgellm: import edgellm.* from the source tree
    python bench/arm64_host.py compare WORK     # WORK/host/*.json vs WORK/arm/*.json; exit 1 on a mismatch
                                                # (WORK/explain.txt: the runs whose board logits would decide it)

The model is seeded and its weights are scaled up so the greedy choices have clear margins (fp32 kernels on
aarch64 round differently from x86). The prompt is text, so the tokenizer runs on the board too.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

PROMPT = "Once upon a time"
RUN_FLAGS = ["--temperature", "0", "--max-new-tokens", "16", "--json", "--threads", "2"]  # after --prompt PROMPT
LONE = "-lone"  # a name ending so runs the export before it with the lone-row stack (edgellm/layout/lone.py)
LONE_FLAGS = ["--exact-decode", "off"]
PLAIN = "-plain"  # ... without speculative decoding
PLAIN_FLAGS = ["--speculative", "off"]
ROWS = ["fp32", "int8", "int4", "int4kv8", "kv16"]  # exports whose rows (decode step vs verification) are reported
NEAR_TIE = 0.05  # a host logit margin under which the board may pick the other token (compare)
EXPLAIN = "explain.txt"  # WORK/EXPLAIN: runs whose first difference needs the board's logits (arm64_logits.py)
# board vs host teacher-forced logits, relative to the host's largest, fp32 / quantized exports: measured on
# cortex-a72 (2026-11-28) fp32 ~3e-6; int8, int4, int4grid, int4min 0.020-0.027 (int8 activations rounded per ISA)
LOGITS_TOL = {False: 1e-3, True: 0.05}
SHIM = '''"""Maps the source tree's folders to their import names (edgellm/, runtime/ -> edgellm.runtime, ...)
without installing it: see pyproject.toml's package-dir."""
import os

_repo = {repo!r}
__path__ = [os.path.join(_repo, "edgellm"), _repo]
with open(os.path.join(_repo, "edgellm", "__init__.py")) as _f:
    exec(compile(_f.read(), _f.name, "exec"))
'''


def prepare(work: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from edgellm.export import ExportOptions, export_model
    from edgellm.model import Decoder, ModelConfig

    exports, host = work / "exports", work / "host"
    for folder in (exports, host):  # always this tree's exports and runs: a cached one may be an older format
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(work / "tokenizer.json"))

    cfg = ModelConfig.preset_config("qwen2", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256,
                                    vocab_size=259, max_seq_len=128)
    model = Decoder(cfg)
    model.reset_parameters(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    model.eval()
    fp32 = exports / "fp32"
    export_model(model, fp32, ExportOptions(max_seq=128, prefill_chunk=16), work / "tokenizer.json",
                 progress=False, log=lambda _: None)
    export_model(model, exports / "kv16", ExportOptions(max_seq=128, prefill_chunk=16, kv_dtype="float16"),
                 work / "tokenizer.json", progress=False, log=lambda _: None)
    # int4 with the MSE clip search: round-to-nearest collapses this scaled-up toy model's greedy output to one
    # repeated token, which would make the comparison weak
    for name, bits, method, more in (("int8", "8", "rtn", []), ("int4", "4", "mse", []),
                                     ("int4kv8", "4", "mse", ["--kv-dtype", "int8"]),
                                     ("int4min", "4", "rtn", ["--block-min", "on"])):
        subprocess.run([sys.executable, "-m", "edgellm", "quantize", str(fp32), "-o", str(exports / name),
                        "--bits", bits, "--method", method, *more, "--no-progress", "--no-check"], check=True,
                       stdout=subprocess.DEVNULL)
    # the same model's layer linears put on a Q4_K_M-like mix of llama.cpp grids; --bits 4 keeps each on its own
    # (quant/grids.py): 4-bit with offsets, int8 g32 and int8 g16 with float32 scales run on the board
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.") and p.dim() == 2:
                p.copy_(torch.from_numpy(on_grid(name, p.numpy())))
    export_model(model, exports / "grid-fp32", ExportOptions(max_seq=128, prefill_chunk=16), work / "tokenizer.json",
                 progress=False, log=lambda _: None)
    subprocess.run([sys.executable, "-m", "edgellm", "quantize", str(exports / "grid-fp32"), "-o",
                    str(exports / "int4grid"), "--bits", "4", "--no-progress", "--no-check"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kept = json.loads((exports / "int4grid" / "manifest.json").read_text())["quantization"]["options"]["kept_grids"]
    if {(b, g, o) for _, b, g, o in kept} != {(4, 32, True), (8, 32, False), (8, 16, False)}:
        raise SystemExit(f"arm64_host: int4grid did not keep the three grids: {kept}")
    names = ["fp32", "int8", "int4", "int4" + LONE, "int4kv8", "int4kv8" + PLAIN, "kv16", "int4min", "int4grid"]
    for name in names:
        export, extra = run_of(name)
        out = json.loads(subprocess.run([sys.executable, "-m", "edgellm", "run", str(exports / export),
                                         "--prompt", PROMPT, *RUN_FLAGS, *extra],
                                        check=True, capture_output=True, text=True).stdout)
        out["margins"] = margins(exports / export, out["prompt_ids"], out["token_ids"])
        (host / f"{name}.json").write_text(json.dumps(out))
    print(" ".join(names))


def on_grid(name: str, w):
    """w [N, K] rounded onto the grid a llama.cpp Q4_K_M file gives such a weight: o 4-bit with a float offset per
    32 weights, its codes not spanning 0..15 and its step no fp16 value (Q4_K); down symmetric 6-bit per 16 (Q6_K);
    the others symmetric 5-bit per 32 with an fp16 step (Q5_0)."""
    import numpy as np

    n, k = w.shape
    if name.endswith("attn.o.weight"):
        b = w.reshape(n, k // 32, 32)
        lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
        s = ((hi - lo) / 13).astype(np.float32)
        m = lo - s
        return (m + s * np.rint((b - m) / s)).reshape(n, k).astype(np.float32)
    block, top, half = (16, 31, False) if name.endswith("mlp.down.weight") else (32, 15, True)
    b = w.reshape(n, k // block, block)
    s = (np.abs(b).max(-1, keepdims=True) / top).astype(np.float16 if half else np.float32).astype(np.float32)
    return (s * np.rint(b / s)).reshape(n, k).astype(np.float32)


def margins(export: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """The host's top-1 minus top-2 logit before each greedy token (teacher-forced): where another machine's
    rounding may pick the other token."""
    import numpy as np

    top = np.sort(teacher_forced(export, prompt, tokens), axis=-1)[:, -2:]
    return [round(float(t[1] - t[0]), 5) for t in top]


def teacher_forced(export: Path, prompt: list[int], tokens: list[int]):
    """The host's logits before each of `tokens` (one forward over the prompt and the tokens but the last)."""
    from edgellm.runtime.engine import Engine
    from edgellm.runtime.manifest import read_manifest

    return Engine.open(export, read_manifest(export)).forward_rows(prompt + tokens[:-1])[len(prompt) - 1:]


def run_of(name: str) -> tuple[str, list[str]]:
    """The export a run name runs and its extra `edgellm run` flags (NAME-lone, NAME-plain: NAME's, with theirs)."""
    for suffix, flags in ((LONE, LONE_FLAGS), (PLAIN, PLAIN_FLAGS)):
        if name.endswith(suffix):
            return name.removesuffix(suffix), flags
    return name, []


def explained(work: Path, name: str, want: dict, i: int) -> str | None:
    """Why the board's first different token i is a near-tie, from its teacher-forced logits
    (WORK/arm/NAME.logits.json): the host's margin there is within twice their largest difference so far, and that
    difference within LOGITS_TOL of the host's scale (a wrong computation is not); None where not."""
    import numpy as np

    path = work / "arm" / f"{name}.logits.json"
    if not path.is_file():
        return None
    board = np.asarray(json.loads(path.read_text())["rows"], dtype=np.float32)[:i + 1]
    export = work / "exports" / run_of(name)[0]
    host = teacher_forced(export, want["prompt_ids"], want["token_ids"])[:i + 1]
    gap = float(np.abs(board - host).max())
    quantized = json.loads((export / "manifest.json").read_text()).get("quantization") is not None
    relative = gap / max(1.0, float(np.abs(host).max()))
    if relative > LOGITS_TOL[quantized] or want["margins"][i] > 2 * gap:
        return None
    return f"the board's logits {gap:.3g} from the host's ({relative:.2g} relative)"


def shim(work: Path, repo: Path) -> None:
    package = work / "shim" / "edgellm"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(SHIM.format(repo=str(repo.resolve())))


def compare(work: Path) -> int:
    """Each run's greedy tokens on the board = the host's, up to a near-tie: the host's margin there under NEAR_TIE
    (the two machines' float rounding may pick either token; an int8 KV cache turns a last-bit difference into a
    whole rounding step) or within what the board's teacher-forced logits measure the machines to differ by
    (`explained`: quantized kernels round int8 activations their own way on each ISA; runs that need it are listed
    in WORK/EXPLAIN for arm64_check.sh to fetch those logits, then compared again); and each NAME-plain run =
    NAME's on the board itself, exactly: `--speculative auto` never changes greedy text there (it speculates only
    where this CPU's rows are exact)."""
    bad, unexplained = 0, []
    arm = {}
    for host_file in sorted((work / "host").glob("*.json")):
        arm_file = work / "arm" / host_file.name
        want = json.loads(host_file.read_text())
        text = arm_file.read_text().strip() if arm_file.is_file() else ""
        got = arm[host_file.stem] = json.loads(text) if text else None
        if got is None:
            print(f"{host_file.stem}: MISSING on the board")
            bad += 1
            continue
        host_ids, arm_ids = want["token_ids"], got["token_ids"]
        i = next((j for j, (a, b) in enumerate(zip(host_ids, arm_ids, strict=False)) if a != b), None)
        why = None if i is None or want["margins"][i] < NEAR_TIE else explained(work, host_file.stem, want, i)
        if i is None and (len(host_ids), want["text"]) == (len(arm_ids), got["text"]):
            verdict = "same greedy tokens"
        elif i is not None and (want["margins"][i] < NEAR_TIE or why):
            verdict = f"same up to a near-tie at token {i} (host margin {want['margins'][i]:.3g}" + \
                      (f"; {why})" if why else ")")
        else:
            verdict = "MISMATCH"
            bad += 1
            unexplained.append(host_file.stem)
        print(f"{host_file.stem}: {verdict} host {host_ids} arm {arm_ids}")
    for name, got in arm.items():
        if name.endswith(PLAIN) and got is not None and arm.get(name.removesuffix(PLAIN)) is not None:
            same = arm[name.removesuffix(PLAIN)]["token_ids"] == got["token_ids"]
            print(f"{name}: speculative {'=' if same else 'DIFFERS FROM'} plain decoding on the board")
            bad += not same
    (work / EXPLAIN).write_text("".join(f"{n} {run_of(n)[0]}\n" for n in unexplained
                                        if not (work / "arm" / f"{n}.logits.json").is_file()))
    return 1 if bad else 0


if __name__ == "__main__":
    action, where = sys.argv[1], Path(sys.argv[2])
    if action == "prepare":
        prepare(where)
    elif action == "shim":
        shim(where, Path(sys.argv[3]))
    else:
        sys.exit(compare(where))
