"""Training: the corpus, token files, window sampling, the schedule, learning, exact resume, crash recovery,
the demo's training stage and the `edgellm train` CLI."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.cli import main
from edgellm.loaders import load_checkpoint, load_extra_state
from edgellm.model import ModelConfig
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.tokenizer import load_tokenizer
from edgellm.train import checkpoint
from edgellm.train.bpe import train_bpe
from edgellm.train.corpus import NUMBERS, generate_corpus, write_corpus
from edgellm.train.data import (
    WindowSampler,
    build_token_file,
    open_token_file,
    token_dtype,
    unigram_entropy,
    windows,
)
from edgellm.train.demo import train_demo
from edgellm.train.loop import TrainConfig, train
from edgellm.train.schedule import lr_at

TINY = dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus.txt, tokenizer.json): 1200 stories and a 320-token BPE trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(str(root / "corpus.txt"), 1200, seed=3)
    train_bpe([root / "corpus.txt"], 320, root / "tokenizer.json")
    return root / "corpus.txt", root / "tokenizer.json"


def tokens_of(corpus, out: Path):
    text, tok_path = corpus
    tok = load_tokenizer(tok_path)
    return build_token_file([text], out, tok.vocab_size, tok, "test"), tok


def tiny_cfg(tok, **over) -> ModelConfig:
    return ModelConfig.preset_config("llama2", vocab_size=tok.vocab_size, **{**TINY, **over})


# ---- corpus ----------------------------------------------------------------------------------------------

def test_corpus_is_seeded_and_its_counts_and_pronouns_are_consistent():
    stories = generate_corpus(300, seed=11)
    assert stories == generate_corpus(300, seed=11)
    assert stories != generate_corpus(300, seed=12)
    assert len(set(stories)) > 290  # varied
    give = re.compile(r"(\w+) has (\w+) (\w+) \w+\. (He|She) gives (\w+) to (\w+)\. Now \1 has (\w+) \3 \w+, "
                      r"and \6 has \5 \3")
    checked = 0
    for s in stories:
        girl = "Her best friend" in s
        assert ("His best friend" in s) != girl
        for m in give.finditer(s):
            n, k, left = (NUMBERS.index(m.group(i)) for i in (2, 5, 7))
            assert n - k == left, m.group(0)
            checked += 1
    assert checked > 50


# ---- schedule ----------------------------------------------------------------------------------------------

def test_schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    lrs = [lr_at(s, 1.0, 0.1, 10, 110) for s in range(120)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)  # half way through the cosine: the mean of max and min
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[109] == pytest.approx(0.1, abs=1e-3) and lrs[119] == 0.1


# ---- token files and windows -----------------------------------------------------------------------------

def test_token_file_frames_documents_is_versioned_and_reused(corpus, tmp_path):
    data, tok = tokens_of(corpus, tmp_path / "tokens.bin")
    assert data.tokens.dtype == token_dtype(tok.vocab_size) == np.uint16
    meta = json.loads((tmp_path / "tokens.json").read_text())
    assert meta["format"] == "edgellm-tokens" and meta["format_version"] == 1
    ids = np.asarray(data.tokens)
    docs = corpus[0].read_text().strip().split("\n\n")
    assert (ids == tok.bos_id).sum() == (ids == tok.eos_id).sum() == len(docs)
    first_end = int(np.argmax(ids == tok.eos_id))
    assert ids[0] == tok.bos_id and tok.decode(ids[1:first_end].tolist()) == docs[0]
    # the same sources and tokenizer: the file is reused, not rewritten
    inode = (tmp_path / "tokens.bin").stat().st_ino
    again, _ = tokens_of(corpus, tmp_path / "tokens.bin")
    assert (tmp_path / "tokens.bin").stat().st_ino == inode and len(again.tokens) == len(ids)
    # an unknown version is refused
    (tmp_path / "tokens.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(EdgeError, match="format_version 99"):
        open_token_file(tmp_path / "tokens.bin")


def test_pretokenized_npy_is_checked_against_the_vocabulary(tmp_path):
    arr = np.arange(1000, dtype=np.int32) % 50
    np.save(tmp_path / "ids.npy", arr)
    data = build_token_file([tmp_path / "ids.npy"], tmp_path / "t.bin", vocab_size=50)
    assert np.array_equal(np.asarray(data.tokens), arr)
    with pytest.raises(EdgeError, match="token id 49 >= vocab_size 40"):
        build_token_file([tmp_path / "ids.npy"], tmp_path / "u.bin", vocab_size=40)
    with pytest.raises(EdgeError, match="nothere.txt: file not found"):
        build_token_file([tmp_path / "nothere.txt"], tmp_path / "v.bin", vocab_size=50)


def test_ranks_slice_the_same_global_batch_and_the_sampler_state_resumes():
    tokens = np.arange(5000, dtype=np.uint16)
    one = WindowSampler(tokens, 16, seed=5)
    ranks = [WindowSampler(tokens, 16, seed=5) for _ in range(2)]
    for _ in range(3):
        x, y = one.draw(8)
        parts = [r.draw(8, rank=i, world=2) for i, r in enumerate(ranks)]
        assert np.array_equal(x, np.concatenate([p[0] for p in parts]))
        assert np.array_equal(y, np.concatenate([p[1] for p in parts]))
        assert np.array_equal(y[:, :-1], x[:, 1:]) and np.array_equal(y[:, -1], x[:, -1] + 1)
    state = one.state()
    ahead = one.draw(8)[0]
    one.set_state(state)
    assert np.array_equal(one.draw(8)[0], ahead)
    x, _ = windows(tokens, np.array([0, 4983]), 16)
    assert x[1, -1] == 4998  # the last offset still has its target inside the array


def test_unigram_entropy():
    assert unigram_entropy(np.array([0, 1, 2, 3]), 8) == pytest.approx(math.log(4))
    assert unigram_entropy(np.array([5, 5, 5]), 8) == pytest.approx(0.0)


# ---- the loop ------------------------------------------------------------------------------------------------

def test_training_lowers_validation_loss_below_the_unigram_entropy(corpus, tmp_path):
    data, tok = tokens_of(corpus, tmp_path / "tokens.bin")
    cfg = TrainConfig(steps=60, batch_size=8, seq_len=48, lr=4e-3, min_lr=4e-4, warmup=5, eval_every=30,
                      eval_steps=2, save_every=1000, seed=0, threads=1)
    result = train(cfg, tiny_cfg(tok), data, tmp_path / "run", progress=False)
    uniform = math.log(tok.vocab_size)  # ~ the untrained model's loss
    assert result.steps == 60 and len(result.losses) == 60
    assert result.val_loss < uniform - 2.0, (result.val_loss, uniform)
    assert result.val_loss < result.unigram_entropy - 0.5, (result.val_loss, result.unigram_entropy)
    assert result.evals[0][1] > result.evals[-1][1]
    loaded = load_checkpoint(tmp_path / "run")  # a native checkpoint export can read, tokenizer-less here
    assert loaded.config == tiny_cfg(tok)


def test_resume_continues_exactly_like_an_uninterrupted_run(corpus, tmp_path):
    data, tok = tokens_of(corpus, tmp_path / "tokens.bin")
    cfg = TrainConfig(steps=10, batch_size=4, seq_len=32, lr=3e-3, warmup=3, grad_accum=2, eval_every=5,
                      eval_steps=1, save_every=1000, seed=1, threads=1)
    mc = tiny_cfg(tok, dropout=0.1)  # dropout: the torch RNG state has to be restored too
    whole = train(cfg, mc, data, tmp_path / "whole", progress=False)
    train(cfg, mc, data, tmp_path / "split", until=5, progress=False)
    state = load_extra_state(tmp_path / "split")
    assert state["step"] == 5 and set(state["optimizer"]["state"][0]) >= {"exp_avg", "exp_avg_sq"}
    resumed = train(cfg, mc, data, tmp_path / "split", resume=True, progress=False)
    assert resumed.losses == whole.losses  # bitwise
    a = load_checkpoint(tmp_path / "whole").model.state_dict()
    b = load_checkpoint(tmp_path / "split").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(EdgeError, match="already holds a training checkpoint"):
        train(cfg, mc, data, tmp_path / "whole", progress=False)


def test_a_run_killed_mid_swap_recovers_the_last_complete_checkpoint(corpus, tmp_path):
    data, tok = tokens_of(corpus, tmp_path / "tokens.bin")
    cfg = TrainConfig(steps=4, batch_size=2, seq_len=16, warmup=1, eval_every=2, eval_steps=1, save_every=2,
                      threads=1)
    out = tmp_path / "run"
    train(cfg, tiny_cfg(tok), data, out, until=2, progress=False)
    # killed after OUT -> OUT.old but before OUT.tmp -> OUT: the finished OUT.tmp wins
    shutil.copytree(out, tmp_path / "run.tmp")
    (out).rename(tmp_path / "run.old")
    checkpoint.recover(out)
    assert checkpoint.is_complete(out) and not (tmp_path / "run.old").exists()
    # killed while OUT.tmp was being written: it is discarded, OUT stays
    (tmp_path / "run.tmp").mkdir()
    (tmp_path / "run.tmp" / "model.safetensors").write_bytes(b"partial")
    result = train(cfg, tiny_cfg(tok), data, out, resume=True, progress=False)
    assert result.steps == 4 and not (tmp_path / "run.tmp").exists()


def test_a_time_budget_fits_the_schedule_and_stops_in_time(corpus, tmp_path):
    data, tok = tokens_of(corpus, tmp_path / "tokens.bin")
    cfg = TrainConfig(steps=100_000, batch_size=2, seq_len=16, warmup=5, eval_every=10_000, eval_steps=1,
                      save_every=10_000, time_budget_s=2.0, threads=1)
    result = train(cfg, tiny_cfg(tok), data, tmp_path / "run", progress=False)
    fitted = load_extra_state(tmp_path / "run")["train_config"]["steps"]
    assert 5 <= result.steps <= fitted < 100_000  # cut to the measured speed at the end of warmup
    assert result.wall_s < cfg.time_budget_s + 3.0


# ---- the demo's training stage ---------------------------------------------------------------------------

def test_demo_training_stage_end_to_end(tmp_path):
    res = train_demo(tmp_path / "demo", budget_s=60, seed=0, size="tiny", progress=False)
    assert res.train.steps == 40
    assert res.val_loss < res.unigram_entropy - 0.5, (res.val_loss, res.unigram_entropy)
    loaded = load_checkpoint(res.out)
    assert loaded.tokenizer_path == res.out / "tokenizer.json"
    assert isinstance(res.sample, str) and len(res.sample) > 10 and res.prompt.count(".") >= 3


# ---- CLI -----------------------------------------------------------------------------------------------------

CLI_SIZE = ["--dim", "32", "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2", "--hidden-dim", "64",
            "--seq-len", "32", "--batch-size", "4", "--eval-every", "2", "--eval-steps", "1", "--quiet",
            "--threads", "1"]


@pytest.mark.parametrize("argv, message", [
    (["--preset", "llama2", "--data", "missing.txt", "--vocab-size", "300"], "--data missing.txt: file not found"),
    (["--preset", "gpt9", "--data", "{corpus}", "--vocab-size", "300"], "--preset gpt9: unknown preset"),
    (["--config", "{config}", "--data", "{corpus}", "--vocab-size", "300"], "unknown config keys: wings"),
    (["--preset", "llama2", "--data", "{corpus}"], "give --tokenizer or --vocab-size"),
])
def test_cli_errors_exit_2_with_one_line(corpus, tmp_path, capsys, argv, message):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"dim": 32, "wings": 2}))
    argv = [a.format(corpus=corpus[0], config=config) for a in argv]
    assert main(["train", *argv, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgellm train: error: ") and message in err and "\n" not in err


def test_cli_trains_a_tokenizer_and_resumes(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["train", "--preset", "llama2", "--data", str(corpus[0]), "-o", str(out), *CLI_SIZE]
    assert main([*base, "--vocab-size", "300", "--steps", "3"]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    assert load_tokenizer(out / "tokenizer.json").vocab_size <= 300
    assert main([*base, "--vocab-size", "300", "--steps", "3"]) == 2  # refuses to overwrite without --resume
    assert main(["train", "--data", str(corpus[0]), "-o", str(out), "--resume", "--steps", "5", "--quiet"]) == 0
    assert load_extra_state(out)["step"] == 5
    assert load_checkpoint(out).config.dim == 32


def test_text_is_read_in_blocks_without_splitting_documents(tmp_path, monkeypatch):
    import edgellm.train.data as data

    docs = generate_corpus(60, seed=4)
    seps = ["\n\n", "\n \n", "\r\n\r\n", "\n\n\n"]
    (tmp_path / "t.txt").write_bytes("".join(d + seps[i % 4] for i, d in enumerate(docs)).encode())
    for block in (7, 1000):
        monkeypatch.setattr(data, "_BLOCK_CHARS", block)
        assert [d for chunk in data._documents(tmp_path / "t.txt") for d in chunk] == docs
    (tmp_path / "bad.txt").write_bytes(b"ok\n\n\xff\xfe")
    with pytest.raises(EdgeError, match="not UTF-8"):
        list(data._documents(tmp_path / "bad.txt"))
