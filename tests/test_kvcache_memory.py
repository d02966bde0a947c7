"""What the static KV cache costs in resident memory: a large cache grows with the rows written, a small one
is plain (malloc'd) memory; both read as zeros where nothing was written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgellm.runtime.kvcache import LAZY_CACHE_BYTES, KVCache

# run where `edgellm run` runs: glibc's huge-page malloc on (cli/hugepages.py), under which np.zeros made a
# cache resident in full before its first row
CHILD = """
import json, sys
import numpy as np
from edgellm.runtime.kvcache import KVCache

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1])

before = anon_kb()
cache = KVCache(4, 8, 4096, 64)  # 4 layers x (K, V) x [1, 8, 4096, 64] fp32: 64 MiB
for i in range(4):
    cache.keys[i][0, :, :16] = 1.0  # 16 rows of every head
    cache.values[i][0, :, :16] = 1.0
print(json.dumps({"kb": anon_kb() - before, "bytes": sum(k.nbytes + v.nbytes for k, v in zip(cache.keys, cache.values))}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status (Linux)")
def test_a_large_cache_is_resident_only_where_rows_were_written() -> None:
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    out = json.loads(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                                    env=env).stdout)
    assert out["bytes"] == 64 << 20 > LAZY_CACHE_BYTES
    # 16 rows of 4 layers x 2 x 8 heads: 64 pages of 4 KiB, 256 KiB; allowed 4 MiB for the interpreter's own
    assert out["kb"] < 4096, out


def test_large_and_small_caches_start_as_zeros_and_keep_what_is_written() -> None:
    for max_seq in (64, 8192):  # 0.5 MiB (malloc'd) and 64 MiB (mapped)
        cache = KVCache(2, 8, max_seq, 64, np.float32)
        for buf in cache.keys + cache.values:
            assert buf.shape == (1, 8, max_seq, 64) and buf.dtype == np.float32 and buf.flags.writeable
            assert buf.flags.c_contiguous and not buf.any()
        cache.keys[1][0, 3, 5] = 2.5
        assert cache.keys[1].sum() == 2.5 * 64 and not cache.keys[0].any() and not cache.values[1].any()
