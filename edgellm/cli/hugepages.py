"""Transparent huge pages for the weights onnxruntime packs at load time (`edgellm run`, `edgellm bench`).

Every decode step streams every packed weight once. onnxruntime packs them into memory it gets from malloc,
in 4 KiB pages: stories110M int4's ~100 MB is ~25,000 pages, far more than a core's TLB holds, so each token
walks page tables ~25,000 times; in 2 MiB pages it is ~50 entries. Kernels in THP mode "madvise" (the default
of Debian, Ubuntu and Raspberry Pi OS) back malloc'd memory with huge pages only when asked, and glibc asks
only when told to at process start: GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35; tunables are read
once, by the dynamic loader). So the two verbs whose speed is the product re-execute themselves with it set,
before anything heavy is imported (one interpreter start, ~60 ms on the dev VM, against a model load of
hundreds of ms). Measured with `edgellm bench` on the dev VM, with and without in alternation (2026-11-23):
decode stories15M fp32 +6 %, Qwen2.5-0.5B int4 +11 %, stories110M fp32 +1 %, Qwen2.5-0.5B fp32 +2 %
(bandwidth-bound), stories110M int4 +0-13 % (medians of three sets: 1.00x, 1.08x, 1.13x); peak RSS +0-13 MB.

The user's word wins: any `glibc.malloc.hugetlb` already in GLIBC_TUNABLES (`=0` opts out) is left alone,
which also stops a second re-execution. Other kernels' modes need nothing ("always" backs every large
mapping already, "never" refuses) and other C libraries ignore the variable, so nothing is re-executed there.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
VERBS = ("run", "bench")  # the verbs worth an interpreter start: decode speed is what they are for
MIN_GLIBC = (2, 35)       # the first glibc that knows the tunable


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's THP mode: "always", "madvise" or "never" (the bracketed word of `path`); "" without THP."""
    try:
        found = re.search(r"\[(\w+)\]", path.read_text())
    except (OSError, UnicodeDecodeError):
        return ""
    return found.group(1) if found else ""


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the glibc this interpreter runs on; None for another C library or platform."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError, TypeError):  # no confstr, unknown name, or an odd answer
        return None


def tunables_with_huge_pages(environ: Mapping[str, str], mode: str, glibc: tuple[int, int] | None) -> str | None:
    """The GLIBC_TUNABLES value to re-execute with, or None to run as the process is."""
    if mode != "madvise" or glibc is None or glibc < MIN_GLIBC:
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if any(item.split("=")[0] == TUNABLE for item in current.split(":")):
        return None
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def environment_with_huge_pages(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` as a child process should get it to run as `edgellm run` runs: with the tunable added where it
    helps (benchmarks start their edgellm workers with it; scripts that start a Python process of their own for
    `Generator` can too). Unchanged where nothing would be re-executed."""
    value = tunables_with_huge_pages(environ, thp_mode(), glibc_version())
    return dict(environ) if value is None else {**environ, "GLIBC_TUNABLES": value}


def relaunch_with_huge_pages(argv: list[str]) -> None:
    """Replace this process by the same command line with huge pages asked for, when `argv` (the command line
    after the program) names a verb in VERBS and it would help; otherwise return and let the caller go on."""
    if not argv or argv[0] not in VERBS or not sys.executable or not getattr(sys, "orig_argv", None):
        return
    env = environment_with_huge_pages(os.environ)
    if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # the interpreter by its full path (argv[0] may be a bare "python" that a changed PATH resolves elsewhere),
        # then its own options, script or -m, and arguments as given
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # no exec here (a sandbox): run in 4 KiB pages, as without this module
