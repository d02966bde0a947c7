"""`Generator`: text generation from an export directory with numpy + onnxruntime only.

    gen = Generator.open("out/model", threads=2)
    for event in gen.generate("Once upon a time", SamplingParams(temperature=0), StopParams(64, seed=0)):
        if isinstance(event, TokenEvent):
            print(event.text, end="", flush=True)
        else:                                # the last item is the Result
            print(event.finish_reason, event.timings.decode_tok_s)

Speed: in a process of its own, open with `config=SessionConfig(threads=..., shared_pool=True)` — one
onnxruntime thread pool for all graphs, what `edgellm run` uses (stories15M decode ~1.6x faster). It is off
by default because onnxruntime then requires every other session in the process to use that pool too. And start
that process as `edgellm run` starts itself, with glibc asked for transparent huge pages for the packed weights
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, or `edgellm.cli.hugepages.environment_with_huge_pages(os.environ)` as
a child's environment): SmolLM2-135M fp32 decode 47-50 -> 58-59 tok/s, int4 +7-14 % (docs/benchmarks.md).

Prompts (runtime/prompts.py): text is tokenized, with BOS in front when the context starts empty and the
checkpoint's tokenizer puts one there (transformers' ids); token ids are used as given; a prompt longer than the
context is an error unless `truncate=True`. `chat(messages)` renders a conversation with the export's chat
template (runtime/chat.py) and reuses the cached prefix it shares with the last one.

Speculative decoding (`speculate("lookup")`, or a draft export; runtime/speculative.py) changes how the tokens
are computed, not which: greedy picks plain decoding's tokens (bit for bit on exports whose verification rows are
decode steps, `Engine.exact_rows`: fused layers, format 10), sampling keeps the distribution, and
`Result.speculative` counts drafted and accepted tokens. Off by default here (the CLI's `run` turns lookup on
where `exact_rows` holds and `speculative.rows_exact_here` measures it so on this CPU, once per export and machine:
`--speculative auto`, rows_memo.py, edgellm/cli/speculation.py). Which stack decodes (`SessionConfig.exact`): by
default the export's lone-row stack (format 13: 8-27 % faster decode than with the spare attention row) until
`speculate` turns speculation on, which reopens the engine on the spare-row stack once (`exact_engine`; ~0.5 s at
SmolLM2-135M int4, ~0.9 s fp32, more at larger models: open with `SessionConfig(exact=True)` to start there);
`exact=False` keeps the lone-row stack whatever happens (a Generator that only samples: rejection sampling needs
no bitwise rows; `exact_rows` is then False). An int8-cache export (format 15) opens the lone-row stack always,
its rows being exact (variant.LONE_EXACT).

Generation stops on EOS (any of the manifest's `eos_ids`; `ignore_eos=True` for benchmarks), a stop string, after
`max_new_tokens`, or when the static context is full: runtime/transcript.py.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator, Sequence
from pathlib import Path
from time import perf_counter

import numpy as np

from .chat import ChatTemplate
from .draft_length import DRAFT_TOKENS, Costs
from .drafting import PromptLookup
from .engine import Engine
from .errors import need
from .events import Result, TokenEvent
from .fileio import safe_join
from .kvcache import KVCache
from .manifest import Manifest, read_manifest
from .prompts import prompt_ids, shared_prefix, truncated
from .sampling import SamplingParams, StopParams, sample
from .session import RunClock, SessionConfig
from .speculative import Stats, configure, speculation_off, speculative_tokens
from .stats import make_timings, peak_rss_mb
from .tokenizer import Tokenizer, load_tokenizer
from .transcript import Transcript
from .variant import stack_role


def export_tokenizer(directory: Path, manifest: Manifest) -> Tokenizer:
    """The tokenizer an export ships (its manifest must name one), without opening any of its graphs."""
    tok = manifest.tokenizer
    return load_tokenizer(safe_join(directory, tok["file"]), manifest.vocab_size, kind=tok["kind"],
                          bos_id=manifest.bos_id, eos_id=manifest.eos_id)


def export_sampling(directory: Path, manifest: Manifest) -> SamplingParams:
    """The sampler defaults an export ships (manifest `sampler`), without opening any of its graphs."""
    return SamplingParams.from_dict(manifest.sampler, f"{directory}/manifest.json: sampler")


class Generator:
    """An opened export: its sessions, its static KV cache and (optionally) its tokenizer."""

    def __init__(self, directory: Path, manifest: Manifest, config: SessionConfig) -> None:
        self.directory, self.manifest = Path(directory), manifest
        self._tokenizer: Tokenizer | None = None     # loaded on first use (`tokenizer`)
        self._chat_template: ChatTemplate | None = None
        m = manifest
        self.cache = KVCache.for_dims(m.dims)
        self.clock = RunClock()
        self.engine = Engine(self.directory, m, self.cache, config, self.clock)
        self.bos_id, self.eos_id = m.bos_id, m.eos_id
        self.add_bos = m.add_bos  # text prompts get bos_id in front (the checkpoint's rule)
        self.eos_ids = frozenset(m.eos_ids)  # any of them ends generation
        self.default_sampling = export_sampling(self.directory, m)
        # the ids in the cache, rows [0, cache.length): the repetition penalty's history, never copied per step
        self._history = np.zeros(m.max_seq, np.int64)
        self._carry: list[int] = []     # the last picked token, not yet fed (kept for keep_context)
        self.speculative, self.draft_tokens, self._draft = "off", DRAFT_TOKENS, None  # see speculate()
        # the verification costs measured on this engine (draft_length.Costs), kept across generations; None when
        # `speculate(timed=False)`. A benchmark comparing settings in one process gives each its own
        self.costs: Costs | None = Costs()

    @classmethod
    def open(cls, directory: str | Path, threads: int | None = None, *, config: SessionConfig | None = None,
             verify: bool = True) -> Generator:
        """Read and check the manifest (sha256 of every file unless `verify=False`, the tokenizer's included),
        create the sessions and the cache. The tokenizer is loaded when first used (`tokenizer`)."""
        directory = Path(directory)
        config = config if config is not None else SessionConfig()
        if threads is not None:
            config = dataclasses.replace(config, threads=threads)
        config.validate()
        return cls(directory, read_manifest(directory, verify=verify), config)

    @property
    def has_tokenizer(self) -> bool:
        return self.manifest.tokenizer is not None

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The export's tokenizer (None without one), loaded on first use: ids in and ids out (an app with its
        own tokenizer, `edgellm bench`) never hold it. Peak RSS of load + 64 ids + 64 tokens without / with it:
        Qwen2.5-0.5B-shape int4 578 / 610 MB (151k tokens), stories110M-shape int4 202 / 215 MB."""
        if self._tokenizer is None and self.manifest.tokenizer is not None:
            self._tokenizer = export_tokenizer(self.directory, self.manifest)
        return self._tokenizer

    def _before_clock(self, text: bool, chat: bool = False) -> None:
        """A request that uses text loads the tokenizer (a chat, the template, which loads it) before its clock
        starts: a one-time load (Gemma 3's 262k tokens: ~0.8 s) is not that prompt's time to first token."""
        if text:
            _ = self.chat_template if chat else self.tokenizer

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The export's chat template (None without one), read on first use, as the tokenizer it needs."""
        m = self.manifest
        if self._chat_template is None and m.tokenizer is not None and m.tokenizer["chat_template"] is not None:
            tok = self.tokenizer
            self._chat_template = ChatTemplate.from_file(safe_join(self.directory, m.tokenizer["chat_template"]),
                                                         tok.token_text(m.bos_id), tok.token_text(m.eos_id))
        return self._chat_template

    def speculate(self, speculative: str = "lookup", draft: str | Path | None = None,
                  draft_tokens: int = DRAFT_TOKENS, config: SessionConfig | None = None, timed: bool = True) -> None:
        """Speculative decoding on ("lookup": prompt lookup; "draft": the export `draft`, same tokenizer, as the
        drafter; up to `draft_tokens` drafts per verification) or "off" (runtime/speculative.py `configure`).
        `timed` False: how many tokens to draft follows from the tokens alone, not from measured step times
        (the same drafts on any machine and load; greedy text is plain decoding's either way). A draft export, once
        open, stays open across mode switches (asking for the same directory again reuses it) until another
        replaces it."""
        configure(self, speculative, draft, draft_tokens, config, timed)

    def reopen(self, config: SessionConfig) -> None:
        """Open the engine again with `config` (the export's other stack), keeping the cache and the context in it.
        The old engine's packed weights go before the new one packs its own; an engine that fails to open leaves
        one of the old configuration in place, and the error raised."""
        old = self.engine.config
        self.engine = None
        gc.collect()
        try:
            self.engine = Engine(self.directory, self.manifest, self.cache, config, self.clock)
        except BaseException:
            self.engine = Engine(self.directory, self.manifest, self.cache, old, self.clock)  # usable as it was
            raise

    def exact_engine(self) -> bool:
        """Reopen the engine on the export's spare-row stack when it was opened with `SessionConfig.exact` None and
        decodes through the lone-row one (speculation is being set up: greedy speculation keeps plain decoding's
        tokens only where each decode step is a verification row). Returns whether it reopened."""
        engine = self.engine
        exact = dataclasses.replace(engine.config, exact=True)
        if engine.config.exact is not None or not engine.stacked or stack_role(self.manifest, exact) == engine.stack_role:
            return False   # a stack pinned, the layer graphs (no stack to change), or the lone one exact already
        self.reopen(exact)
        return True

    # ------------------------------------------------------------------------------------------ prompts

    def encode(self, prompt: str | Sequence[int], fresh: bool = True) -> list[int]:
        """Token ids for a prompt: text is tokenized (BOS in front when `fresh` and the export's rule adds one),
        ids are checked and used as given."""
        bos = [self.bos_id] if fresh and self.add_bos else []
        return prompt_ids(prompt, lambda: self.tokenizer, bos, self.manifest.vocab_size, str(self.directory))

    @property
    def context_tokens(self) -> int:
        """Tokens in the current context: cached rows plus the picked token not yet fed."""
        return self.cache.length + len(self._carry)

    def fits(self, prompt_ids: Sequence[int]) -> bool:
        """Whether these ids (plus the carried-over token) fit in the context kept by `keep_context`."""
        return len(self._carry) + len(prompt_ids) <= self.cache.free

    def reset(self) -> None:
        """Forget the context (the buffers stay allocated)."""
        self.cache.reset()
        self._carry.clear()

    # --------------------------------------------------------------------------------------- generation

    def generate(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                 stop: StopParams | None = None, *, truncate: bool = False, ignore_eos: bool = False,
                 keep_context: bool = False, text: bool = True) -> Iterator[TokenEvent | Result]:
        """Yield a TokenEvent per new token as it is picked, then the Result.

        `keep_context=True` continues the current context (interactive use); if the prompt does not fit in
        what is left, the context is reset first. `text=False` skips detokenizing (ids only, as benchmarks
        time it; no stop strings then). Arguments are checked here, before the first token.
        """
        self._before_clock(text or isinstance(prompt, str))
        start = perf_counter()
        sampling, stop = self._checked(sampling, stop, text)
        if keep_context and self.context_tokens > 0:
            ids = self.encode(prompt, fresh=False)
            if not self.fits(ids):
                self.reset()
                ids = self.encode(prompt, fresh=True)
        else:
            self.reset()
            ids = self.encode(prompt, fresh=True)
        feed = truncated(self._carry + ids, self.cache.max_seq, truncate, stop.max_new_tokens, self.bos_id)
        self._carry = []
        return self._run(feed, sampling, stop, ignore_eos, start, text)

    def chat(self, messages: Sequence[dict], sampling: SamplingParams | None = None,
             stop: StopParams | None = None, *, text: bool = True) -> Iterator[TokenEvent | Result]:
        """Like `generate`, for the assistant's reply to `messages` ([{"role": "user", "content": ...}, ...])
        rendered with the export's chat template. The context carries over: the cache is rewound to the longest
        prefix the rendered conversation shares with it, and only the rest is fed (a follow-up question costs
        its own tokens, not the whole conversation's)."""
        self._before_clock(True, chat=True)
        start = perf_counter()
        sampling, stop = self._checked(sampling, stop, text)
        ids = self.chat_ids(messages)
        need(0 < len(ids) <= self.cache.max_seq,
             f"chat: the conversation is {len(ids)} tokens, the context holds {self.cache.max_seq} (max_seq of "
             "the export): drop earlier turns")
        keep = shared_prefix(self._history[:self.cache.length], ids)
        keep = keep if self.cache.can_rewind(keep) else 0  # ring caches (sliding layers) cannot go back
        self.cache.rewind(keep)
        self._carry = []
        return self._run(ids[keep:], sampling, stop, False, start, text)

    def check_chat(self) -> None:
        """EdgeError unless the export has a chat template."""
        need(self.chat_template is not None,
             f"chat: {self.directory} has no chat template (export a model whose tokenizer_config.json has one, "
             "or pass `edgellm export --chat-template FILE`)")

    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """The token ids of a conversation rendered with the chat template, ending with the assistant's turn."""
        self.check_chat()
        return self.tokenizer.encode_template(self.chat_template.render(messages))

    def _checked(self, sampling: SamplingParams | None, stop: StopParams | None,
                 text: bool) -> tuple[SamplingParams, StopParams]:
        sampling = sampling if sampling is not None else self.default_sampling
        stop = stop if stop is not None else StopParams()
        sampling.validate()
        stop.validate()
        need(not stop.stop or self.has_tokenizer,
             f"stop: {self.directory} has no tokenizer, so there is no text to match stop strings in")
        need(not stop.stop or text, "stop strings need the text: generate(..., text=True)")
        return sampling, stop

    def _run(self, feed: list[int], sampling: SamplingParams, stop: StopParams, ignore_eos: bool,
             start: float, with_text: bool) -> Iterator[TokenEvent | Result]:
        rng = stop.rng()
        penalise = sampling.repetition_penalty != 1.0
        plain_greedy = sampling.temperature == 0 and not penalise
        # the k-th new token is fed to row length + k - 1 after the prompt (the last one is row max_seq - 1):
        # counted here, not read off the cache, whose length a verification moves past the accepted drafts
        out = Transcript(self.tokenizer if with_text else None, stop, frozenset() if ignore_eos else self.eos_ids,
                         self.cache.free - len(feed))
        first = last = start
        run_at_first = 0.0
        spec = None
        if stop.max_new_tokens == 0:
            self._carry = feed  # nothing generated: the prompt waits for the next call
        else:
            logits = self.engine.forward_columns(feed)   # the head's column order: `pick` reads it
            self._history[self.cache.length - len(feed):self.cache.length] = feed

            columns = self.engine.columns

            def pick(logits: np.ndarray) -> int:
                return columns.token(logits) if plain_greedy else sample(
                    columns.vocab(logits), sampling, rng, self._history[:self.cache.length] if penalise else ())

            source = self._plain_tokens(pick, logits)
            # greedy with a repetition penalty: plain (its per-row history is not worth the code)
            if self.speculative != "off" and speculation_off(self.cache) is None and not (
                    sampling.temperature == 0 and penalise):
                spec = Stats(self.speculative)
                drafter = self._draft if self.speculative == "draft" else PromptLookup()
                greedy = sampling.temperature == 0
                source = speculative_tokens(self, drafter, self.draft_tokens, pick, logits,
                                            None if greedy else sampling, rng, stop.max_new_tokens, spec)
            for token in source:
                last = perf_counter()
                if not out.tokens:
                    first, run_at_first = last, self.clock.seconds
                delta = out.push(token)
                if delta is None:  # EOS: every token before it is in the cache (a speculative source rewinds to it)
                    self._carry = []
                    break
                self._carry = [token]  # picked, not fed yet: even if the caller stops iterating here
                yield TokenEvent(token, delta)
                if out.reason:
                    break
            source.close()  # a speculative source rewinds the cache to the last token's rows
        tail = out.tail()
        if tail:
            yield TokenEvent(None, tail)
        timings = make_timings(len(feed), len(out.tokens), max(out.picked - 1, 0), first - start, last - first,
                               self.clock.seconds - run_at_first)
        yield Result(out.tokens, "".join(out.text), out.reason, feed, timings, peak_rss_mb(),
                     spec.to_dict() if spec else None)

    def _plain_tokens(self, pick, logits: np.ndarray) -> Iterator[int]:
        """One token per forward: picked, yielded (not fed yet), then fed when the caller asks for the next."""
        while True:
            token = pick(logits)
            yield token
            logits = self.engine.forward_columns((token,))
            self._carry = []
            self._history[self.cache.length - 1] = token

    def complete(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                 stop: StopParams | None = None, *, truncate: bool = False, ignore_eos: bool = False,
                 keep_context: bool = False, text: bool = True) -> Result:
        """`generate` run to the end; returns only the Result."""
        result = None
        for item in self.generate(prompt, sampling, stop, truncate=truncate, ignore_eos=ignore_eos,
                                  keep_context=keep_context, text=text):
            result = item
        assert isinstance(result, Result)
        return result
