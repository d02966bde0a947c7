"""onnxruntime's process-wide ("global") intra-op thread pool, shared by every session of an export.

Layer granularity runs N + 2 sessions per token. With one pool per session, each Run wakes a different
worker thread that has slept since the previous token; one shared pool keeps a single worker hot (measured:
docs/benchmarks.md, "Runtime design measurements").

The catch is onnxruntime's, and process-wide: once the global pool exists, every session created in the
process must set `use_per_session_threads = False` (onnxruntime refuses any other), and the pool's size can
never change. So it is opt-in (`SessionConfig(shared_pool=True)`); `edgellm run` / `edgellm bench` turn it on
when they own the process.
"""

from __future__ import annotations

_created_with: list[int] = []  # the pool's size once this module created it (a list: no `global` needed)


def ensure_shared_pool(threads: int | None) -> bool:
    """Create the global pool (once per process) with `threads` intra-op threads (None/0: onnxruntime's
    default). True if the pool exists afterwards; False if this onnxruntime cannot make one. A pool made
    earlier keeps its size: `threads` is then ignored."""
    if _created_with:
        return True
    try:
        from onnxruntime.capi import _pybind_state  # the only place the Python API exposes this
        _pybind_state.set_global_thread_pool_sizes(threads or 0, 1)
    except (ImportError, AttributeError):
        return False
    except Exception as err:  # onnxruntime's Fail: someone else made the pool already
        if "already been created" not in str(err):
            return False
    _created_with.append(threads or 0)
    return True


def needs_global_pool(error: Exception) -> bool:
    """Whether a session failed only because the process has a global pool (made by other code)."""
    return "use_per_session_threads must be false" in str(error)
