"""`edgellm run` / `edgellm bench` re-execute themselves with glibc asked for transparent huge pages
(edgellm/cli/hugepages.py): when, with what, and that the packed weights then sit in huge pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edgellm.cli.hugepages import MIN_GLIBC, glibc_version, thp_mode, tunables_with_huge_pages
from tests.runtime_fixtures import bigram_export

GLIBC = (2, 36)


@pytest.mark.parametrize("text, mode", [
    ("always [madvise] never\n", "madvise"),
    ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"),
    ("always madvise never\n", ""),  # no choice marked: not something to act on
    ("\xff\xfe", ""),
])
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_bytes(text.encode("latin-1"))
    assert thp_mode(path) == mode


def test_thp_mode_without_the_file_is_empty(tmp_path):
    assert thp_mode(tmp_path / "missing") == ""


def test_the_tunable_is_added_only_where_it_helps():
    assert tunables_with_huge_pages({}, "madvise", GLIBC) == "glibc.malloc.hugetlb=1"
    # the user's other tunables are kept
    assert (tunables_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", GLIBC)
            == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    # the user's own choice wins (and stops a second re-execution); a tunable that merely starts alike does not
    assert tunables_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", GLIBC) is None
    assert tunables_with_huge_pages({"GLIBC_TUNABLES": "a=1:glibc.malloc.hugetlb=2"}, "madvise", GLIBC) is None
    assert (tunables_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlbx=0"}, "madvise", GLIBC)
            == "glibc.malloc.hugetlbx=0:glibc.malloc.hugetlb=1")
    # "always" needs no request, "never" and no THP refuse it; an old glibc or another C library ignores it
    for mode in ("always", "never", ""):
        assert tunables_with_huge_pages({}, mode, GLIBC) is None
    assert tunables_with_huge_pages({}, "madvise", (2, 34)) is None
    assert tunables_with_huge_pages({}, "madvise", MIN_GLIBC) == "glibc.malloc.hugetlb=1"
    assert tunables_with_huge_pages({}, "madvise", None) is None


def _bench_huge_mb(export, env: dict[str, str]) -> float:
    proc = subprocess.run([sys.executable, "-m", "edgellm", "bench", str(export), "--json", "--runs", "1",
                           "--new-tokens", "2", "--contexts", "4", "--threads", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["huge_pages_mb"]


def test_bench_runs_in_huge_pages_unless_told_not_to(tmp_path_factory):
    # the case the module is for, and the dev VM's and CI's (THP "madvise", glibc 2.36): runs there
    if thp_mode() != "madvise" or (glibc_version() or (0, 0)) < MIN_GLIBC:
        pytest.skip(f"THP mode {thp_mode()!r}, glibc {glibc_version()}: nothing is re-executed here")
    export = bigram_export(tmp_path_factory)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    # re-executed with glibc.malloc.hugetlb=1: onnxruntime's heap is backed by 2 MiB pages
    assert _bench_huge_mb(export, env) >= 2
    # the user's opt-out is kept: nothing asks for huge pages, none are used
    assert _bench_huge_mb(export, {**env, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == 0


_MALLOC_CHILD = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
ctypes.memset(libc.malloc(size), 1, size)  # malloc'd like onnxruntime's packed weights (numpy asks by itself)
from edgellm.runtime.stats import huge_pages_mb
print(huge_pages_mb())
"""


def _child_huge_mb(env: dict[str, str]) -> float:
    proc = subprocess.run([sys.executable, "-c", _MALLOC_CHILD], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout)


def test_a_child_started_with_the_environment_gets_huge_pages():
    # what the benchmarks start edgellm's workers with (bench/speculative_race.py): the same rule as the re-execution
    from edgellm.cli.hugepages import environment_with_huge_pages

    if thp_mode() != "madvise" or (glibc_version() or (0, 0)) < MIN_GLIBC:
        pytest.skip(f"THP mode {thp_mode()!r}, glibc {glibc_version()}: nothing to ask for here")
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env = environment_with_huge_pages(plain)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and {**env, "GLIBC_TUNABLES": ""} == {**plain,
                                                                                                   "GLIBC_TUNABLES": ""}
    assert _child_huge_mb(env) >= 32
    assert _child_huge_mb(plain) == 0
    opted_out = {**plain, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert environment_with_huge_pages(opted_out) == opted_out
