"""`dspark generate`: one prompt, streamed, speculative or plain."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from dspark.cli.common import POLICIES, open_target, positive_int, target_args
from dspark.errors import DsparkError

if TYPE_CHECKING:
    from dspark.model.target import Target


def add_parsers(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="generate text for one prompt (speculative or plain)",
        description="Generate a reply to one prompt, streaming it to stdout, then print a stats line to "
        "stderr. Output is distributed exactly as the target's own sampling (token-identical "
        "at --temperature 0) whatever the drafter.",
    )
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (rendered with the model's chat template)")
    src.add_argument("--prompt-ids", metavar="IDS",
                     help="the prompt as comma-separated token ids, fed as they are (targets without a tokenizer too); "
                     "the reply is printed as token ids")
    g.add_argument("--raw", action="store_true", help="feed --prompt as raw text, without the chat template")
    g.add_argument("--max-new-tokens", type=positive_int, default=256, help="generation budget (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    target_args(g, threads=True)
    g.add_argument("--drafter", default="auto",
                   help="auto | none | prompt-lookup | PATH to a drafter checkpoint (auto and PATH optionally "
                   "+lookup: prompt-lookup branches in each token tree), each optionally @POLICY (the same as "
                   "--policy POLICY). Default auto: the DSpark drafter dspark ships for the target (the embedded "
                   "SmolLM2) with prompt-lookup branches and the tree policy (auto@POLICY: without the branches), "
                   "else prompt-lookup")
    g.add_argument("--policy", default=None, metavar="POLICY",
                   help=f"how many drafts of each round the target verifies: {POLICIES}. full = every draft (the "
                   "default for a PATH); tree = a token tree grown best-first, as many of its drafts as raise "
                   "expected tokens/s on the profiled target's cost curve (the default for auto); tree:N = a tree "
                   "of N drafts; dspark = the chain's prefix that raises expected tokens/s; threshold:C = while the "
                   "calibrated prefix survival >= C; fixed:K = the first K; ar = none (plain decoding)")
    g.add_argument("--num-draft-tokens", type=positive_int, default=None, help="max draft tokens per round")
    g.add_argument("--confidence-threshold", type=float, default=None, metavar="C",
                   help="verify drafts only while their calibrated prefix survival >= C (drafters with a confidence head)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DsparkError(f"--prompt-ids expects comma-separated token ids, got {text!r}") from None
    if not ids:
        raise DsparkError("--prompt-ids is empty; give at least one token id")
    return ids


def cmd_generate(args) -> int:
    from dspark.decode.generate import Decoder
    from dspark.decode.speculation import AUTO, check_drafter_spec, load_speculation, with_policy
    from dspark.decode.streaming import TextStreamer
    from dspark.model.loading import parse_dtype
    from dspark.sampling import SamplingParams

    # validate everything cheap before loading the model
    prompt_ids = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if prompt_ids is None and not args.prompt.strip():
        raise DsparkError("the prompt is empty; pass some text with --prompt")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    parse_dtype(args.dtype)
    spec = with_policy(args.drafter, args.policy)
    check_drafter_spec(spec)

    target = open_target(args, require_tokenizer=False)
    if target.tokenizer is None and (prompt_ids is None or args.stop):
        raise DsparkError(f"{target.path} has no tokenizer files (tokenizer.json / tokenizer_config.json): "
                          f"{'--stop needs one' if prompt_ids is not None else 'pass the prompt as token ids with --prompt-ids'}")
    drafter_spec, drafter, policy = load_speculation(
        spec, target, args.num_draft_tokens, args.confidence_threshold,
        auto="@full" if args.confidence_threshold is not None else AUTO)
    if prompt_ids is None:
        prompt_ids = target.encode_prompt(args.prompt, chat=not args.raw)
    else:
        target.check_token_ids(prompt_ids, "--prompt-ids")
    decoder = Decoder(target, drafter, policy)

    streamer = None
    if not args.json and args.prompt_ids is None:
        streamer = TextStreamer(target.decode, lambda s: print(s, end="", flush=True), args.stop)
    result = decoder.generate(
        prompt_ids,
        args.max_new_tokens,
        params,
        seed=args.seed,
        stop=args.stop,
        on_tokens=streamer.push if streamer else None,
    )
    _report(args, target, result, streamer, drafter_spec)
    return 0


def _report(args, target: Target, result, streamer, drafter_spec: str | None) -> None:
    """The reply's end (JSON, text or token ids) on stdout, the stats line on stderr."""
    s = result.stats
    if args.json:
        stats = {k: getattr(s, k) for k in ("new_tokens", "rounds", "tau", "drafts_per_round", "decode_tok_s", "prefill_s", "decode_s",
                                            "draft_s", "verify_s")}
        text = result.text if target.tokenizer is not None else None
        print(json.dumps({"text": text, "token_ids": result.token_ids, "finish_reason": result.finish_reason, "stats": stats}))
    else:
        if streamer:
            streamer.finish(result.text)
            print()
        else:  # token ids in, token ids out
            print(",".join(map(str, result.token_ids)))
        print(
            f"[dspark] {s.new_tokens} tokens, {s.rounds} rounds, tau {s.tau:.2f} "
            f"({s.drafts_per_round:.1f} drafts verified per round), "
            f"decode {s.decode_tok_s:.1f} tok/s (draft {s.draft_s:.2f} s + verify {s.verify_s:.2f} s), "
            f"prefill {s.prefill_s:.2f} s, "
            f"drafter {drafter_spec}, {target.model.precision} {_runner_name(target, args.runner)}, finish {result.finish_reason}",
            file=sys.stderr,
        )


def _runner_name(target, asked: str) -> str:
    """"compiled", or "eager" with a word on why where --runner auto did not take a compiled runner."""
    from dspark.model.compiled import runner_built, runs_compiled

    model = target.model
    if model.compiled is not None:
        return "compiled"
    if asked == "auto" and runs_compiled(model):
        if runner_built(target.path):
            return "eager (`dspark compile` measured the compiled runner slower on this CPU)"
        return "eager (run `dspark compile` once for the compiled runner)"
    return "eager"
