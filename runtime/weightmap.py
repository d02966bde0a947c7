"""One read-only memory map per external-data file, shared by every session of an export (runtime/session.py opens
them): initializers handed to onnxruntime as views of the map, lookup tables mapped a page per row read, and the
pages of weights onnxruntime packs dropped while it packs them. Which graphs read the maps and which pre-pack
their own copy is `placement.plan`'s decision."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import EdgeError, need
from .fileio import safe_join
from .onnxmeta import DTYPES, GraphInfo

_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # None: no madvise here (Windows); pages then stay mapped
_RANDOM = getattr(mmap, "MADV_RANDOM", None)


def _small_pages(data: mmap.mmap) -> None:
    """Map a lookup table one 4 KiB page per row read, not one page-cache folio. A prefill reads rows all over
    the table, and Linux 6.18 maps the whole large folio around each faulting address (up to 2 MiB; large folios
    come from readahead, i.e. from the sha256 check, the export that wrote the file, or a session that loaded the
    file itself): a 64-token prompt made 22 of stories110M int4's 24.7 MB table resident at once, on top of
    everything else (peak RSS 221 -> 197 MB). So the map is read without readahead, and once a session is open the
    file's cached pages are dropped (`_drop_cached`, from `SharedWeights.drop_cached_tables`): each fault then
    reads and maps one page (one small I/O per table page first read: a 4 KiB page holds 4-7 rows of a 576-896
    wide int8 table). Measured in separate processes, the file put back in large folios before each (2026-11-27):
    peak RSS stories110M int4 202-204 -> 191-196 MB, Qwen2.5-0.5B int4 590 -> 528-532 MB, decode unchanged; the
    first prompt's table pages are read from disk (stories110M 64-token prefill 2190 -> 1902 tok/s, SmolLM2 1430
    -> 1093; Qwen2.5-0.5B unchanged)."""
    if _RANDOM is not None:
        try:
            data.madvise(_RANDOM)
        except OSError:  # advice only: a file system that refuses it (FUSE, some network mounts) loses nothing else
            pass


def _drop_cached(path: Path) -> None:
    """Drop a file's pages from the page cache (where no process maps them: clean pages, nothing is lost)."""
    if hasattr(os, "posix_fadvise"):
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:  # advice only, as above
            pass


class SharedWeights:
    """One read-only memory map per external-data file, shared by every session that points into it."""

    def __init__(self, directory: Path, tables: tuple[str, ...] = ()) -> None:
        """`tables`: the lookup-table files (placement.py), mapped page by page (`_small_pages`)."""
        self.directory = Path(directory)
        self.tables = frozenset(tables)
        self._maps: dict[str, mmap.mmap] = {}
        self._values: dict[tuple[str, int, int, int, tuple[int, ...]], ort.OrtValue] = {}

    def _map(self, rel: str) -> mmap.mmap:
        if rel not in self._maps:
            path = safe_join(self.directory, rel)
            try:
                with open(path, "rb") as f:
                    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    if rel in self.tables:
                        _small_pages(data)
                    self._maps[rel] = data
            except (OSError, ValueError) as err:  # ValueError: an empty file cannot be mapped
                raise EdgeError(f"{path}: cannot map the weights ({err})") from None
        return self._maps[rel]

    def add_to(self, options: ort.SessionOptions, graph_path: Path, info: GraphInfo, names: frozenset[str]) -> None:
        """Register the external initializers `names` of `graph_path` with `options` as views of the shared map."""
        base = Path(graph_path).parent
        for t in info.external:
            dtype = DTYPES.get(t.data_type)
            if t.name not in names or dtype is None:
                continue  # a type numpy lacks: onnxruntime loads this one itself
            rel = os.path.relpath(base / t.location, self.directory).replace(os.sep, "/")
            count = int(np.prod(t.shape, dtype=np.int64))
            length = count * dtype.itemsize if t.length < 0 else t.length
            need(length == count * dtype.itemsize,
                 f"{graph_path}: initializer {t.name!r} has {length} bytes, expected {count * dtype.itemsize}")
            key = (rel, t.offset, length, t.data_type, t.shape)
            if key not in self._values:
                data = self._map(rel)
                need(t.offset + length <= len(data),
                     f"{graph_path}: initializer {t.name!r} ends past the end of {rel}")
                array = np.frombuffer(data, dtype, count, t.offset).reshape(t.shape)
                self._values[key] = ort.OrtValue.ortvalue_from_numpy(array)
            options.add_initializer(t.name, self._values[key])

    def drop_cached_tables(self) -> None:
        """Drop the page cache of the table files mapped so far (`_small_pages`), after each session opens: the
        sha256 check read them in large folios, and a session that loads such a file itself (a tied head, whose
        codes the embedding gathers) reads it back into them (Qwen2.5-0.5B int4: 49 MB of head.data resident after
        a 64-token prefill when the drop came only at mapping time, against 0.3)."""
        for rel in self._maps:
            if rel in self.tables:
                _drop_cached(safe_join(self.directory, rel))

    def release(self, rels: tuple[str, ...]) -> None:
        """Drop these files' pages from this process's RSS (they stay in the page cache; the next read
        maps them back without I/O). For weights read only now and then: a prefill graph's, between runs."""
        if not _DONTNEED:
            return
        for rel in rels:
            data = self._maps.get(rel)
            if data is not None:
                data.madvise(_DONTNEED)

    def close(self) -> None:
        """Drop the maps (call only once no session uses them)."""
        self._values.clear()
        self._maps.clear()


# while onnxruntime packs a graph's weights, the scales it has copied are dropped this often: from the shared map,
# they would otherwise all be resident at the end of the session's creation, on top of the packed copy
# (Qwen2.5-0.5B int4: 45 MB of float32 scales, load peak 505 MB against 470 steady)
PACKING_RELEASE_S = 0.01


@contextmanager
def released_while(weights: SharedWeights, files: tuple[str, ...]) -> Iterator[None]:
    """Release `files` (`SharedWeights.release`) every PACKING_RELEASE_S from another thread while the block
    runs, and once after it. A page released before onnxruntime read it is read again from the file (clean,
    read-only file pages: dropping one loses nothing), so the interleaving cannot change a value."""
    if not files:
        yield
        return
    done = threading.Event()

    def loop() -> None:
        while not done.wait(PACKING_RELEASE_S):
            weights.release(files)

    worker = threading.Thread(target=loop, name="edgellm-release", daemon=True)
    worker.start()
    try:
        yield
    finally:
        done.set()
        worker.join()
        weights.release(files)
