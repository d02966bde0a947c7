"""The peak RSS that `edgellm run` and `edgellm bench` report is the process's own."""

from __future__ import annotations

import subprocess
import sys

from edgellm.runtime.stats import peak_rss_mb

CHILD = """
from edgellm.runtime.stats import peak_rss_mb
start = peak_rss_mb()
block = bytearray(100 << 20)
block[::4096] = b"\\x01" * len(block[::4096])  # touch every page
print(start, peak_rss_mb())
"""


def test_a_child_reports_its_own_peak_not_its_launchers():
    # ru_maxrss carries a parent's peak across fork + exec; `edgellm run` launched by the demo, a notebook or a
    # bench driver must report its own. This process holds > 300 MiB when it starts the child.
    block = bytearray(300 << 20)
    block[::4096] = b"\x01" * len(block[::4096])
    assert peak_rss_mb() > 300
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    start, end = map(float, out.split())
    assert 1 < start < 150, start                   # not this process's > 300 MiB
    assert end >= start + 95 and end < 300, (start, end)  # its own 100 MiB counted
    del block
