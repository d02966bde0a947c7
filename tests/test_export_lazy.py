"""Export from a lazily loaded checkpoint (what `edgellm export` does): the same bytes as from the resident
model, never more than one unit's parameters in memory, and freed parameters really freed."""

from __future__ import annotations

import contextlib

import pytest
import torch

from edgellm.export import ExportOptions, export_model
from edgellm.export.e2e import forward_by_parts
from edgellm.export.graphs import plan_units
from edgellm.export.journal import export_identity
from edgellm.loaders import load_checkpoint, save_checkpoint
from edgellm.loaders.lazy import LazyWeights, Resident
from edgellm.runtime.manifest import read_manifest
from tests.export_helpers import tiny_model

OPTIONS = ExportOptions(max_seq=64, prefill_chunk=8)


def _resident_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.device.type != "meta"}


class Watched(LazyWeights):
    """Records which parameters are in memory each time a part is held."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen: list[set[str]] = []

    @contextlib.contextmanager
    def holding(self, prefixes):
        with super().holding(prefixes):
            self.seen.append(_resident_names(self.model))
            yield


@pytest.fixture(scope="module", params=["qwen2", "llama2"])  # tied table + biases; untied lm_head
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    save_checkpoint(tiny_model(request.param, seed=3, n_layers=3), root / "ckpt")
    return root


def test_lazy_export_is_the_resident_export(checkpoint):
    """Same files (sha256), same verification figures, same journal identity: an export interrupted in one
    mode resumes in the other."""
    resident = load_checkpoint(checkpoint / "ckpt")
    with load_checkpoint(checkpoint / "ckpt", lazy=True).weights as lazy:
        assert _resident_names(lazy.model) == set()  # nothing read yet
        assert export_identity(lazy.model.cfg, lazy.tensors(), OPTIONS) == \
            export_identity(resident.model.cfg, Resident(resident.model).tensors(), OPTIONS)
        export_model(lazy.model, checkpoint / "lazy", OPTIONS, progress=False, log=lambda _: None, weights=lazy)
        assert _resident_names(lazy.model) == set()  # and nothing left behind
    export_model(resident.model, checkpoint / "resident", OPTIONS, progress=False, log=lambda _: None)
    a, b = read_manifest(checkpoint / "lazy"), read_manifest(checkpoint / "resident")
    assert a.files == b.files and a.verification == b.verification


def test_lazy_export_holds_one_unit_at_a_time(checkpoint, tmp_path):
    ckpt = load_checkpoint(checkpoint / "ckpt", lazy=True)
    with Watched(ckpt.model, ckpt.weights.plan, ckpt.weights.source) as watched:
        export_model(watched.model, tmp_path / "out", OPTIONS, progress=False, log=lambda _: None, weights=watched)
        units = [{n for n, _ in watched.model.named_parameters() if n.startswith(u.weight_prefixes)}
                 for u in plan_units(watched.model, "layer", "inplace", (False,) * watched.model.cfg.n_layers)]
    held = [names for names in watched.seen if len(names) > 1]  # the identity hash holds single tensors
    assert held and all(any(names <= unit for unit in units) for names in held), held
    assert any(names == units[-1] for names in held)  # a whole layer was held at once (the test can fail)


def test_released_parameters_are_emptied(checkpoint):
    """A reference kept to a released parameter (torch.onnx's rewriter keeps its last graph) holds no memory."""
    with load_checkpoint(checkpoint / "ckpt", lazy=True).weights as lazy:
        with lazy.holding(("layers.1.",)):
            kept = lazy.model.layers[1].attn.qkv.weight
            assert kept.numel() > 0 and kept.abs().sum() > 0
            with lazy.holding(("layers.1.attn.",)):  # nested: released by the outermost exit only
                pass
            assert lazy.model.layers[1].attn.qkv.weight is kept
        assert kept.numel() == 0 and lazy.model.layers[1].attn.qkv.weight.device.type == "meta"


def test_forward_by_parts_is_the_decoder_forward(checkpoint):
    """The end-to-end check's PyTorch reference, run part by part, is bit-identical to Decoder.forward."""
    model = load_checkpoint(checkpoint / "ckpt").model
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens)[0]
    assert torch.equal(forward_by_parts(Resident(model), tokens), want)
    with load_checkpoint(checkpoint / "ckpt", lazy=True).weights as lazy:
        lazy.model.set_context_len(model.cfg.max_seq_len)
        assert torch.equal(forward_by_parts(lazy, tokens), want)


def test_lazy_gguf_export_is_the_resident_export(tmp_path):
    """A .gguf loads lazily too (edgellm export's path): each tensor is dequantized when its unit needs it,
    and the export is byte for byte the one from the fully dequantized model."""
    from tests.gguf_helpers import Q, bpe_vocab, hf_model, write_gguf

    v = bpe_vocab()
    path = write_gguf(tmp_path / "tiny.gguf", hf_model("qwen2", len(v["tokens"]), seed=5), "qwen2", v, Q.Q8_0)
    resident = load_checkpoint(path)
    with load_checkpoint(path, lazy=True).weights as lazy:
        assert _resident_names(lazy.model) == set()
        export_model(lazy.model, tmp_path / "lazy", OPTIONS, progress=False, log=lambda _: None, weights=lazy)
        assert _resident_names(lazy.model) == set()
    export_model(resident.model, tmp_path / "resident", OPTIONS, progress=False, log=lambda _: None)
    a, b = read_manifest(tmp_path / "lazy"), read_manifest(tmp_path / "resident")
    assert a.files == b.files and a.verification == b.verification


def test_lazy_gemma3_hf_export_is_the_resident_export(tmp_path):
    """Gemma 3's (1 + w) norm gains are added as each tensor is read, so a Gemma 3 HF directory loads lazily
    too (it used to load whole): the same export, and the same logits as transformers."""
    from tests.test_gemma3 import hf_logits, save_gemma

    hf = save_gemma(tmp_path / "hf", seed=2)
    resident = load_checkpoint(tmp_path / "hf")
    tokens = [3, 9, 27, 81, 5, 15, 45]
    with load_checkpoint(tmp_path / "hf", lazy=True).weights as lazy:
        assert _resident_names(lazy.model) == set()
        lazy.model.set_context_len(resident.model.cfg.max_seq_len)
        assert torch.allclose(forward_by_parts(lazy, torch.tensor([tokens])),
                              torch.from_numpy(hf_logits(hf, tokens)), atol=1e-4)
        export_model(lazy.model, tmp_path / "lazy", OPTIONS, progress=False, log=lambda _: None, weights=lazy)
        assert _resident_names(lazy.model) == set()
    export_model(resident.model, tmp_path / "resident", OPTIONS, progress=False, log=lambda _: None)
    a, b = read_manifest(tmp_path / "lazy"), read_manifest(tmp_path / "resident")
    assert a.files == b.files and a.verification == b.verification
