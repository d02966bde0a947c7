"""File helpers shared by every stage that writes an artifact (export, quant, train, diff) or reads one.

Outputs appear all at once or not at all: a crash, Ctrl-C or full disk half-way through an export must never
leave a directory that looks complete. Paths read from a manifest are untrusted and pass through `safe_join`.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import EdgeError, need

_CHUNK = 1 << 20  # sha256 reads 1 MiB at a time: constant memory for multi-GB weight files


@contextlib.contextmanager
def _os_errors(path: Path, doing: str) -> Iterator[None]:
    """Full disk, permissions, read-only mounts: OSError -> one-line EdgeError naming the path."""
    try:
        yield
    except OSError as err:
        raise EdgeError(f"{path}: cannot {doing} ({err.strerror or err})") from None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with _os_errors(path, "read"), open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (a board can lose power right after an export lands)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory (Windows): the rename is all we can do
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the data files were synced already
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory + fsync + os.replace."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with _os_errors(path, "write"):
            # os.open with 0o666 (not mkstemp's 0o600) so the file gets the usual umask permissions
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the temp may never have been created
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write_bytes` of UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_dir(final: Path, marker: str | None = None) -> Iterator[Path]:
    """Yield a fresh temporary sibling of `final` to fill; it becomes `final` only if the block completes.

    A previous `final` is replaced (renamed aside, the new one renamed in, the old one deleted), so readers
    see either the old complete output or the new one. With `marker`, an existing non-empty `final` is
    replaced only if it holds that file (e.g. "manifest.json"): a mistyped --out never deletes an unrelated
    directory. On any exception the temporary directory is removed and `final` is untouched.
    """
    final = Path(final)
    if final.exists():
        need(final.is_dir(), f"{final}: exists and is not a directory")
        need(marker is None or (final / marker).is_file() or not any(final.iterdir()),
             f"{final}: exists and has no {marker}, refusing to replace it (choose a new or empty directory)")
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    with _os_errors(final, "create the output directory"):
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(final)
        shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crashed run that had our pid
        tmp.mkdir()
    try:
        yield tmp
        with _os_errors(final, "move the finished output into place"):
            _swap_in(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed into place


def _remove_stale_temps(final: Path) -> None:
    """Delete `.NAME.tmp-PID` siblings whose process is gone: a killed (SIGKILL, power loss) run cannot clean
    up, and each one may hold a model-sized partial output. A live PID's directory is another run's work."""
    for path in final.parent.glob(f".{glob.escape(final.name)}.tmp-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                _remove(path)


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there: never guess
        return True
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except OSError:  # EPERM (another user's process) or a platform without this check: assume alive
        return True
    return True


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename the complete `tmp` to `final`; an old `final` goes aside first and is deleted last."""
    _fsync_dir(tmp)
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)  # put the previous complete output back
            raise
        _remove(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def _remove(path: Path) -> None:
    """Delete a file, a symlink (not its target) or a directory tree."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def safe_join(root: Path, rel: str) -> Path:
    """`root / rel` for an untrusted relative POSIX path, refusing anything that can land outside root.

    Refused: non-strings, empty, absolute or drive paths, backslashes, NUL, `..` components, and paths whose
    symlinks resolve outside root.
    """
    parts = PurePosixPath(rel).parts if isinstance(rel, str) and "\x00" not in rel and "\\" not in rel else ()
    need(bool(parts) and not rel.startswith("/") and ".." not in parts and ":" not in parts[0],
         f"{root}: unsafe path {rel!r} (expected a relative path inside the directory)")
    path = Path(root).joinpath(*parts)
    try:
        inside = path.resolve().is_relative_to(Path(root).resolve())
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop on Python < 3.13
        raise EdgeError(f"{root}: cannot resolve {rel!r}: {err}") from None
    need(inside, f"{root}: path {rel!r} resolves outside the directory (symlink?)")
    return path


@dataclass(frozen=True)
class FileSpec:
    """A manifest `files` entry: what a file of an export must hash to, and its size."""

    sha256: str
    bytes: int


def describe_files(directory: Path, relpaths: list[str]) -> dict[str, FileSpec]:
    """The `files` entry for files already written under `directory`."""
    files = {}
    for rel in relpaths:
        path = safe_join(Path(directory), rel)
        files[rel] = FileSpec(sha256_file(path), path.stat().st_size)
    return files


def check_files(directory: Path, files: dict[str, FileSpec], hash_files: bool) -> None:
    """Every listed file exists with its size (and sha256 when `hash_files`); EdgeError naming the path."""
    for rel, spec in files.items():
        path = safe_join(directory, rel)
        try:
            need(path.is_file(), f"{path}: listed in files but missing")
            size = path.stat().st_size
            need(size == spec.bytes, f"{path}: {size} bytes, the manifest says {spec.bytes} (truncated copy?)")
            need(not hash_files or sha256_file(path) == spec.sha256, f"{path}: sha256 differs from the manifest")
        except OSError as err:
            raise EdgeError(f"{path}: cannot read ({err.strerror})") from None
