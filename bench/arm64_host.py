"""Host half of bench/arm64_check.sh: tiny exports (fp32, int8, int4, and fp32 with an fp16 KV cache: kv16) and
their greedy outputs on this machine (int4 also through its lone-row stack, `--exact-decode off`).

    python bench/arm64_host.py prepare WORK     # WORK/exports/{fp32,int8,int4,kv16}, WORK/host/<name>.json
    python bench/arm64_host.py shim WORK REPO   # WORK/shim/edgellm: import edgellm.* from the source tree
    python bench/arm64_host.py compare WORK     # WORK/host/*.json vs WORK/arm/*.json; exit 1 on a mismatch

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
    shutil.rmtree(exports, ignore_errors=True)  # always this tree's exports: a cached one may be an older format
    exports.mkdir(parents=True)
    host.mkdir(exist_ok=True)
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
    for bits, method in (("8", "rtn"), ("4", "mse")):
        subprocess.run([sys.executable, "-m", "edgellm", "quantize", str(fp32), "-o", str(exports / f"int{bits}"),
                        "--bits", bits, "--method", method, "--no-progress", "--no-check"], check=True,
                       stdout=subprocess.DEVNULL)
    names = ["fp32", "int8", "int4", "int4" + LONE, "kv16"]
    for name in names:
        lone = name.endswith(LONE)
        out = subprocess.run([sys.executable, "-m", "edgellm", "run", str(exports / name.removesuffix(LONE)),
                              "--prompt", PROMPT, *RUN_FLAGS, *(LONE_FLAGS if lone else [])],
                             check=True, capture_output=True, text=True).stdout
        (host / f"{name}.json").write_text(out)
    print(" ".join(names))


def shim(work: Path, repo: Path) -> None:
    package = work / "shim" / "edgellm"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(SHIM.format(repo=str(repo.resolve())))


def compare(work: Path) -> int:
    bad = 0
    for host_file in sorted((work / "host").glob("*.json")):
        arm_file = work / "arm" / host_file.name
        want = json.loads(host_file.read_text())
        text = arm_file.read_text().strip() if arm_file.is_file() else ""
        got = json.loads(text) if text else None
        same = got is not None and (got["token_ids"], got["text"]) == (want["token_ids"], want["text"])
        print(f"{host_file.stem}: {'same greedy tokens' if same else 'MISMATCH'} "
              f"host {want['token_ids']} arm {got['token_ids'] if got else 'missing'}")
        bad += not same
    return 1 if bad else 0


if __name__ == "__main__":
    action, where = sys.argv[1], Path(sys.argv[2])
    if action == "prepare":
        prepare(where)
    elif action == "shim":
        shim(where, Path(sys.argv[3]))
    else:
        sys.exit(compare(where))
