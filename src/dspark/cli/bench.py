"""`dspark bench serve`: closed-loop load benchmark of the verification policies."""

from __future__ import annotations

import sys
from pathlib import Path

from dspark.cli.common import command_group, open_target, positive_int, target_args
from dspark.errors import DsparkError
from dspark.util.files import check_writable


def add_parsers(sub) -> None:
    bsub = command_group(sub, "bench", "benchmarks", "Benchmarks.")
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
    bs.add_argument("--requests", type=positive_int, default=32, help="requests per level and policy (default 32)")
    bs.add_argument("--max-new-tokens", type=positive_int, default=128, help="(default 128)")
    bs.add_argument("--temperature", type=float, default=0.0)
    bs.add_argument("--dataset", action="append", default=None, help="prompt JSONL (default: the bundled eval sets)")
    bs.add_argument("--sps-max-tokens", type=positive_int, default=None,
                    help="profile SPS(B) up to this B (default: max concurrency x 9, capped at 256)")
    bs.add_argument("--out", required=True, help="output directory")
    target_args(bs)
    bs.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> int:
    from dspark.eval.prompts import default_datasets, load_eval_prompts
    from dspark.model.loading import parse_dtype
    from dspark.schedule.policies import SPSTable, parse_policy
    from dspark.schedule.sps import load_or_measure
    from dspark.serve.bench import bench_serve, write_bench_report

    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise DsparkError(f"--concurrency expects comma-separated integers, got {args.concurrency!r}") from None
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:  # validate names before loading anything
        parse_policy(p, SPSTable((1.0,)))
    prompts = [p for d in (args.dataset or default_datasets()) for p in load_eval_prompts(d)]
    check_writable(args.out)
    parse_dtype(args.dtype)
    target = open_target(args)
    sps_max = args.sps_max_tokens or min(256, max(levels) * 9)
    sps, _, _ = load_or_measure(target, max_tokens=sps_max)
    out = Path(args.out)
    result = bench_serve(target, args.drafter, policies, levels, prompts, args.requests, args.max_new_tokens, sps,
                         args.temperature, journal_path=out / "journal.jsonl")
    write_bench_report(result, out, "dspark " + " ".join(sys.argv[1:]))
    print((out / "serve.md").read_text())
    return 0
