"""Issue 23 measurement: a Gemma 3 270M-shaped model (18 layers, dim 640, 4/1 heads, hd 256, ffn 2048, window 512, 5:1 pattern) with a
32k vocabulary (the 262k one only grows the head), random weights; exported fused and standard at max_seq 2048.

    python bench/gemma3_ring.py fused standard    # -> /tmp/g3/bench/{fused,standard}
    edgellm bench /tmp/g3/bench/fused --threads 1 --runs 3 --new-tokens 32 --contexts 64,1024
"""
import sys
import time
from pathlib import Path

from edgellm.export import ExportOptions, export_model
from edgellm.model import Decoder, ModelConfig

cfg = ModelConfig.preset_config("gemma3", vocab_size=32000, dim=640, n_layers=18, n_heads=4, n_kv_heads=1,
                                head_dim=256, hidden_dim=2048, sliding_window=512, max_seq_len=2048,
                                layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(18)))
m = Decoder(cfg)
m.reset_parameters(seed=0)
for att in sys.argv[1:]:
    t = time.time()
    export_model(m, Path(f"/tmp/g3/bench/{att}"), ExportOptions(max_seq=2048, prefill_chunk=32, attention=att),
                 progress=False)
    print(att, "export s", time.time() - t, flush=True)
