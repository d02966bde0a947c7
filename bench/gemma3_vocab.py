"""Issue 23 check: the 262,144-token tied embedding of Gemma 3 (dim 640, 2 layers: 1 sliding + 1 full): export fp32, quantize int4
and int8, run greedy; print sizes, timings and agreement with the PyTorch model (writes /tmp/g3/vocab)."""
import time
from pathlib import Path

import numpy as np
import torch

from edgellm.export import ExportOptions, export_model
from edgellm.model import Decoder, ModelConfig
from edgellm.quant.export_dir import quantize_export
from edgellm.quant.options import QuantizeOptions
from edgellm.runtime import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams

cfg = ModelConfig.preset_config("gemma3", vocab_size=262144, dim=640, n_layers=2, n_heads=4, n_kv_heads=1,
                                head_dim=256, hidden_dim=2048, sliding_window=512, max_seq_len=1024,
                                layer_types=("sliding", "full"))
m = Decoder(cfg)
m.reset_parameters(seed=0)
root = Path("/tmp/g3/vocab")
t = time.time()
export_model(m, root / "fp32", ExportOptions(max_seq=1024, prefill_chunk=32), progress=False, log=lambda _: None)
print("export fp32 s", round(time.time() - t, 1), flush=True)
prompt = list(range(1000, 1040))
with torch.no_grad():
    ids = list(prompt)
    for _ in range(16):
        ids.append(int(m(torch.tensor([ids]))[0][0, -1].argmax()))
want = ids[len(prompt):]
for bits in (8, 4):
    t = time.time()
    quantize_export(root / "fp32", root / f"int{bits}", QuantizeOptions(bits=bits), check=False, progress=False, log=lambda _: None)
    size = sum(f.stat().st_size for f in (root / f"int{bits}").iterdir()) / 1e6
    got = Generator.open(root / f"int{bits}", threads=1).complete(prompt, SamplingParams(temperature=0), StopParams(16, seed=0), ignore_eos=True).token_ids
    print(f"int{bits}: quantize s {time.time() - t:.1f}, {size:.1f} MB, greedy agreement {np.mean(np.array(got) == np.array(want)):.2f}", flush=True)
got = Generator.open(root / "fp32", threads=1).complete(prompt, SamplingParams(temperature=0), StopParams(16, seed=0), ignore_eos=True).token_ids
print("fp32 greedy agreement", np.mean(np.array(got) == np.array(want)), "fp32 MB", sum(f.stat().st_size for f in (root / "fp32").iterdir()) / 1e6, flush=True)
