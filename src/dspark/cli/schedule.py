"""`dspark profile` and `dspark simulate`: the SPS cost curve and scheduler predictions."""

from __future__ import annotations

from pathlib import Path

from dspark.cli.common import open_target, positive_int, target_args
from dspark.errors import DsparkError
from dspark.util.files import check_writable


def add_parsers(sub) -> None:
    pr = sub.add_parser(
        "profile",
        help="measure the target's steps/s for every verify size B (the scheduler's cost curve)",
        description="Measure SPS(B), target forwards per second for B = 1..--max-tokens verify tokens, cache it "
        "under the dspark cache directory (keyed by model, dtype, threads and machine), print it and plot it.",
    )
    target_args(pr, threads=True)
    pr.add_argument("--max-tokens", type=positive_int, default=64, help="largest B (default 64)")
    pr.add_argument("--context", type=positive_int, default=256, help="tokens already in the cache (default 256)")
    pr.add_argument("--reps", type=positive_int, default=5, help="timed sweeps, median taken (default 5)")
    pr.add_argument("--force", action="store_true", help="measure again even if a cached table exists")
    pr.add_argument("--plot", default="sps.png", help="PNG to write (default sps.png)")
    pr.set_defaults(func=cmd_profile)

    si = sub.add_parser(
        "simulate",
        help="predict scheduler throughput from an SPS curve, without a model",
        description="Run scheduler policies on synthetic confidences and acceptance draws with any SPS curve "
        "(e.g. another machine's `dspark profile` output) and report aggregate and per-user tokens/s. Tree "
        "policies grow each request's token tree over a calibrated synthetic drafter (the best child of a "
        "node at depth d holds accept-mean x 0.97^d, seven more share the rest); their 'avg verify len' is "
        "the tree's drafts.",
    )
    si.add_argument("--sps", required=True, help="'1:40,2:39,...' (every B from 1) or a JSON file from `dspark profile`")
    si.add_argument("--policy", action="append", default=None,
                    help="ar | full | fixed:K | threshold:C | dspark | dspark-async | tree | tree:N (repeatable; "
                    "default: ar, fixed:1, fixed:GAMMA, threshold:0.5, dspark, dspark-async, tree)")
    si.add_argument("--concurrency", default="1,2,4,8", help="comma-separated request counts (default 1,2,4,8)")
    si.add_argument("--gamma", type=positive_int, default=8, help="drafts per request and step (default 8)")
    si.add_argument("--accept-mean", type=float, default=0.8, help="mean acceptance at position 0 (default 0.8)")
    si.add_argument("--steps", type=positive_int, default=2000, help="simulated steps per point (default 2000)")
    si.add_argument("--draft-ms", type=float, default=0.0,
                    help="milliseconds one drafting pass adds to a step (default 0); dspark policies skip drafting "
                    "while it does not pay")
    si.add_argument("--seed", type=int, default=0)
    si.set_defaults(func=cmd_simulate)


def cmd_profile(args) -> int:
    import torch

    from dspark.model.loading import parse_dtype
    from dspark.schedule.sps import fit_context, load_or_measure, plot_sps

    check_writable(args.plot, "file", "plot")
    parse_dtype(args.dtype)
    target = open_target(args, require_tokenizer=False)
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
    specs = args.policy or ["ar", "fixed:1", f"fixed:{args.gamma}", "threshold:0.5", "dspark", "dspark-async", "tree"]
    print("policy          concurrency  tok/s    per-user  avg verify len   tau")
    for spec in specs:
        for c in levels:
            r = simulate(parse_policy(spec, sps), sps, c, args.gamma, args.steps, args.accept_mean, seed=args.seed,
                         draft_s=args.draft_ms / 1000)
            print(f"{r.policy:15s} {c:11d} {r.throughput:8.1f} {r.per_user:9.1f} {r.avg_verify_len:15.2f} {r.tau:6.2f}")
    return 0
