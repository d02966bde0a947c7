"""`edgellm run DIR`: generate text from an export directory (numpy + onnxruntime; no torch needed).

Text streams to stdout as it is generated; one stats line (prompt tokens, time to first token, prefill
and decode tok/s, peak RSS) follows on stderr. `--json` prints one JSON object instead:
{"schema": "edgellm-run", "version": 2, "text", "token_ids", "finish_reason", "prompt_ids", "stats": {...}}
(version 2 added `prompt_ids`, the ids fed for the prompt: BOS first when the checkpoint's tokenizer adds one;
`stats.speculative` {mode, drafted, accepted, verifications} is there when speculative decoding ran).
Sampling flags left out take the export's defaults (manifest `sampler`).
`--interactive` reads prompts from stdin, one per line, until EOF; the context carries over between turns
(each later turn is fed as "\\n" + the line) until it is full, then it is reset with a notice on stderr.
`--chat` sends the prompt (or each line) as a user message through the model's chat template (exports of
instruct models carry it); with `--interactive` the conversation carries over, its oldest exchanges dropped
(with a notice) when it outgrows the context.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import integer, number
from .speculation import add_exact_flag, add_speculative_flags, note_no_lone_stack, open_generator, speculate

JSON_SCHEMA = "edgellm-run"
JSON_VERSION = 2
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from an export directory (board side: no torch)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path, help="export directory (holds manifest.json)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (BOS goes in front when the checkpoint's tokenizer adds one: "
                                         "`edgellm info DIR` says)")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, used as given (no tokenizer "
                                             "needed)")
    p.add_argument("--max-new-tokens", type=integer, default=256, help="at most this many new tokens (default 256)")
    p.add_argument("--temperature", type=number, help="0 = greedy (default: the export's sampler)")
    p.add_argument("--top-k", type=integer, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=number, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--min-p", type=number, help="drop tokens below min_p x the top probability (0 = off)")
    p.add_argument("--repetition-penalty", type=number, help="> 1 discourages repeats (1 = off)")
    p.add_argument("--seed", type=integer, help="seed of the random draws (default: fresh entropy)")
    p.add_argument("--threads", type=integer, help="onnxruntime intra-op threads (default: onnxruntime's choice)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the text contains STR (not printed); repeatable")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print text as it is generated (default) or all at the end")
    p.add_argument("--json", action="store_true", help="print one JSON object (schema edgellm-run v2)")
    p.add_argument("--interactive", action="store_true", help="read prompts from stdin, one per line, until EOF")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user message, rendered with the export's chat template")
    p.add_argument("--system", help="with --chat: a system message first")
    p.add_argument("--truncate", action="store_true",
                   help="a prompt longer than the context keeps its last tokens instead of failing")
    add_pool_flag(p, "run")
    add_prefill_weights_flag(p)
    add_speculative_flags(p)
    add_exact_flag(p)
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the sha256 check of the export's files (sizes are still checked)")
    p.set_defaults(func=run)


def add_pool_flag(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("--thread-pool", choices=("auto", "shared", "per-session"), default="auto",
                   help="shared: one onnxruntime thread pool for all graphs (much faster decoding, but "
                        "process-wide: every other onnxruntime session in the process must then use it); "
                        f"auto (default): shared when this process was started as `edgellm {verb}`")


PREFILL_WEIGHTS = {"auto": None, "packed": True, "mapped": False}  # -> SessionConfig.prepack_prefill


def add_prefill_weights_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-weights", choices=tuple(PREFILL_WEIGHTS), default="auto",
                   help="packed: the prefill graphs pre-pack their weights (fast prefill, a second packed copy in "
                        "RAM); mapped: they read the mapped file in place (lowest RSS, slower prefill); auto "
                        "(default): packed for quantized exports, whose kernels are many times slower unpacked. "
                        "The stack graph (default exports, fp32 and quantize's fast format) and paired layers hold one "
                        "packed copy and ignore this: it applies to exports without them (e.g. --attention standard, "
                        "--format portable)")


def shared_pool(choice: str, verb: str) -> bool:
    """`--thread-pool`: auto means this process is ours (`edgellm VERB ...`), not a caller's main([...])."""
    if choice == "auto":
        return len(sys.argv) > 1 and sys.argv[1] == verb
    return choice == "shared"


def _prompt_ids(text: str) -> list[int]:
    """--prompt-ids (and each stdin line of an --interactive export without a tokenizer): comma-separated ids."""
    from edgellm.runtime.errors import EdgeError

    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise EdgeError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise EdgeError("--prompt-ids: expected at least one token id")
    return ids


def _params(args: argparse.Namespace):
    """(given sampling flags, StopParams), validated before anything is loaded."""
    from edgellm.runtime.sampling import SamplingParams, StopParams

    given = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    SamplingParams(**given)  # EdgeError naming the first bad flag
    return given, StopParams(args.max_new_tokens, args.seed, tuple(args.stop))


def run(args: argparse.Namespace) -> int:
    from edgellm.runtime.errors import need
    from edgellm.runtime.generator import export_sampling
    from edgellm.runtime.manifest import read_manifest
    from edgellm.runtime.sampling import SamplingParams
    from edgellm.runtime.session import SessionConfig

    given, stop = _params(args)
    config = SessionConfig(threads=args.threads, shared_pool=shared_pool(args.thread_pool, "run"),
                           prepack_prefill=PREFILL_WEIGHTS[args.prefill_weights])
    config.validate()
    if args.interactive:
        need(args.prompt is None and args.prompt_ids is None,
             "--interactive: reads prompts from stdin; drop --prompt/--prompt-ids")
    else:
        need(args.prompt is not None or args.prompt_ids is not None,
             "expected --prompt TEXT, --prompt-ids IDS or --interactive")
        need(args.prompt is None or args.prompt != "", "--prompt: expected a non-empty prompt")
    need(args.system is None or args.chat, "--system: needs --chat")
    need(not args.chat or args.prompt_ids is None, "--chat: takes --prompt text, not --prompt-ids")
    need(not (args.chat and args.truncate), "--truncate: not with --chat (earlier exchanges are dropped instead)")
    ids = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    need(args.speculative != "draft" or args.draft is not None, "--speculative draft: needs --draft DIR")
    need(args.draft is None or args.speculative == "draft", "--draft: needs --speculative draft")
    manifest = read_manifest(args.directory, verify=args.verify)
    # the export's defaults under the flags given; checked by generate, before the first token
    sampling = SamplingParams(**{**export_sampling(args.directory, manifest).to_dict(), **given})
    gen, known = open_generator(args.directory, manifest, config, args.exact_decode, sampling.temperature,
                                args.speculative)
    note_no_lone_stack(manifest, args.exact_decode, args.directory)
    speculate(gen, args, config, sampled=sampling.temperature != 0, known=known)
    if args.chat:
        gen.check_chat()  # once, not per line
        return _chat(gen, sampling, stop, args)
    if args.interactive:
        if gen.chat_template is not None:
            print("[this export has a chat template: --chat sends each line as a user message through it]",
                  file=sys.stderr)
        return _interactive(gen, sampling, stop, args)
    _show(gen, gen.generate(ids if ids is not None else args.prompt, sampling, stop, truncate=args.truncate), args)
    return 0


def _show(gen, events, args: argparse.Namespace):
    """One generation's events (`Generator.generate` / `chat`): stream (or collect) its output, then the stats
    line or the JSON object. Returns the Result."""
    from edgellm.runtime.generator import Result
    from edgellm.runtime.stats import format_stats

    stream = args.stream and not args.json
    no_text = not gen.has_tokenizer  # ids only: show the new ids instead of text
    result = None
    for item in events:
        if isinstance(item, Result):
            result = item
        elif stream:
            piece = (f"{item.token_id} " if item.token_id is not None else "") if no_text else item.text
            sys.stdout.write(piece)
            sys.stdout.flush()
    assert result is not None
    if args.json:
        doc = result.to_dict()
        doc = {k: v for k, v in doc.items() if k != "stats"} | {"prompt_ids": list(result.prompt_ids),
                                                                "stats": doc["stats"]}
        print(json.dumps({"schema": JSON_SCHEMA, "version": JSON_VERSION, **doc}))
        return result
    if not stream:
        sys.stdout.write(" ".join(map(str, result.token_ids)) if no_text else result.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[{result.finish_reason}] " + format_stats(result.timings, result.peak_rss_mb), file=sys.stderr)
    return result


def _chat(gen, sampling, stop, args: argparse.Namespace) -> int:
    """--chat: one reply to --prompt, or (--interactive) a conversation, one user message per stdin line."""
    from edgellm.runtime.errors import EdgeError

    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    if not args.interactive:
        _show(gen, gen.chat(system + [{"role": "user", "content": args.prompt}], sampling, stop), args)
        return 0
    turns: list[dict] = []  # user and assistant messages, oldest first
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        turns.append({"role": "user", "content": line})
        try:
            while len(turns) > 1 and len(gen.chat_ids(system + turns)) > gen.cache.max_seq:
                del turns[:2]  # the oldest exchange
                print("[context full: dropped the oldest exchange]", file=sys.stderr)
            result = _show(gen, gen.chat(system + turns, sampling, stop), args)
            turns.append({"role": "assistant", "content": result.text})
        except EdgeError as err:  # e.g. this message alone does not fit: it stays out of the conversation
            turns.pop()
            print(f"edgellm run: error: {err}", file=sys.stderr)
    return 0


def _interactive(gen, sampling, stop, args: argparse.Namespace) -> int:
    from edgellm.runtime.errors import EdgeError

    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        try:
            fresh = gen.context_tokens == 0
            if not gen.has_tokenizer:
                prompt: str | list[int] = _prompt_ids(line)
            else:
                prompt = line if fresh else "\n" + line
            if not fresh and not gen.fits(gen.encode(prompt, fresh=False)):
                print("[context full: starting a new context]", file=sys.stderr)
                gen.reset()
                prompt = line if gen.has_tokenizer else prompt
            _show(gen, gen.generate(prompt, sampling, stop, truncate=args.truncate, keep_context=True), args)
        except EdgeError as err:  # a bad line (too long, bad ids) must not end the session
            print(f"edgellm run: error: {err}", file=sys.stderr)
    return 0
