"""A checkpoint's weights left in its file until a part of the model is needed (`load_checkpoint(lazy=True)`).

Export works one unit at a time (the head, the embedding, one layer), so it never needs the whole float32
model resident: `LazyWeights.holding(prefixes)` fills the parameters under those state-dict prefixes from
the checkpoint (float32, one source tensor at a time, as `fill_model` does) and puts them back on the meta
device on exit, which frees them. The model itself is a meta-device `Decoder` whose RoPE buffers are real.
A 1.5B-parameter checkpoint (6.2 GB as float32) then exports holding one layer, or the tied embedding table,
at a time.

`Resident` is the same interface over an ordinary, fully loaded model (holding is a no-op), so callers take
either.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from edgellm.model import Decoder
from edgellm.model.rope import Rotary
from edgellm.runtime.errors import need

from .tensors import Plan, fill_model, materialize


class Weights(Protocol):
    """Where a model's parameters come from while a caller works on parts of it."""

    model: Decoder

    def holding(self, prefixes: tuple[str, ...]) -> contextlib.AbstractContextManager[None]: ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class Resident:
    """A model whose parameters are all in memory: holding changes nothing."""

    def __init__(self, model: Decoder) -> None:
        self.model = model

    def holding(self, prefixes: tuple[str, ...]) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of the state dict in name order."""
        yield from sorted(self.model.state_dict().items())


class LazyWeights:
    """`model` (meta device) + the plan and source that fill it; close (or use as a context manager) to close
    the source. Parameters held by nested `holding` calls stay until the outermost of them exits."""

    def __init__(self, meta: Decoder, plan: Plan, source) -> None:
        transient = {name for name, _ in meta.named_buffers()} - set(meta.state_dict())
        need(all(name.startswith(("rotary.", "rotary_local.")) for name in transient),
             f"internal: lazy loading cannot rebuild buffers {sorted(transient)}")
        for module, local in (("rotary", False), ("rotary_local", True)):  # RoPE tables: computed, not loaded
            if any(name.startswith(module + ".") for name in transient):
                for name, buf in Rotary(meta.cfg, local=local).named_buffers():
                    setattr(getattr(meta, module), name, buf)
        self.model, self.plan, self.source = meta, plan, source
        self._held: Counter[str] = Counter()

    def _names(self, prefixes: tuple[str, ...]) -> list[str]:
        return [name for name in self.plan if name.startswith(prefixes)]

    @contextlib.contextmanager
    def holding(self, prefixes: tuple[str, ...]) -> Iterator[None]:
        names = self._names(prefixes)
        fresh = [name for name in names if self._held[name] == 0]
        for name in fresh:
            _swap(self.model, name, "cpu")
        self._held.update(names)
        try:
            fill_model(self.model, {name: self.plan[name] for name in fresh}, self.source)
            yield
        finally:
            self._held.subtract(names)
            for name in names:
                if self._held[name] == 0:
                    _swap(self.model, name, "meta")  # drops the float32 copy

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, float32 tensor) of the state dict in name order, each read when asked for and valid until
        the next is asked for."""
        for name in sorted(self.plan):
            with self.holding((name,)):
                yield name, self.model.get_parameter(name).detach()

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> LazyWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _swap(model: Decoder, name: str, device: str) -> None:
    """Replace parameter `name` with an uninitialised float32 one on `device` ("cpu" to fill, "meta" to free).

    Freeing also empties the old Parameter object, so a reference someone kept to it does not keep its
    memory: torch.onnx's rewriter (onnxscript pattern matchers, module globals) holds the last graph it
    traced until the next trace, and that graph holds the lifted parameters themselves (measured: the
    0.54 GB embedding table of the Qwen2.5-0.5B head stayed resident through the whole export).
    """
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters[leaf]
    need(old is not None, f"internal: {name} is not a parameter")
    module._parameters[leaf] = nn.Parameter(torch.empty(old.shape, dtype=torch.float32, device=device),
                                            requires_grad=old.requires_grad)
    if device == "meta" and old.device.type != "meta":
        old.data = torch.empty(0)  # a view taken from it (a numpy array) still keeps its storage alive


def model_or_weights(meta: Decoder, plan: Plan, source, lazy: bool) -> tuple[Decoder, LazyWeights | None]:
    """What every loader ends with, once `plan` is checked against `source`: `lazy`, the meta-device model and a
    LazyWeights that now owns `source`; else the model filled from `source` (eval mode), which is then closed.
    Either way the caller closes `source` only when something before this call failed."""
    if lazy:
        weights = LazyWeights(meta.eval(), plan, source)
        return weights.model, weights
    try:
        model = materialize(meta)
        fill_model(model, plan, source)
    finally:
        source.close()
    return model.eval(), None
