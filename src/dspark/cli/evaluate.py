"""`dspark eval` and `dspark calibrate`: acceptance, calibration, speed; STS fitting."""

from __future__ import annotations

from pathlib import Path

from dspark.cli.common import POLICIES, open_target, positive_int, target_args
from dspark.errors import DsparkError
from dspark.util.files import check_writable


def add_parsers(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="accepted length, acceptance, calibration and speed of drafters vs plain AR",
        description="Run every --drafter and plain AR on the same prompts (order rotated per prompt so "
        "machine drift hits all alike) and write OUT/results.json, OUT/report.md and plots: τ, conditional "
        "acceptance per block position, verify efficiency, decode tok/s, speedup over AR, and for drafters "
        "with a confidence head ECE / ROC-AUC / Brier of the prefix-survival product. Finished generations are kept "
        "in OUT/journal.jsonl: rerunning the same command after an interruption resumes where it stopped, on "
        "this or another machine (a prompt cut short is redone whole, so its engines are timed side by side; "
        "the report counts generations by CPU flags).",
    )
    ev.add_argument("--drafter", action="append", required=True,
                    help="auto | prompt-lookup | PATH, auto and PATH optionally +lookup, each optionally @POLICY "
                    "(repeatable; auto = the bundled drafter of the target with prompt-lookup branches in its trees "
                    "and the tree policy, auto@full = the drafter alone verifying every draft; a PATH alone "
                    f"verifies every draft, PATH+lookup a tree). POLICY: {POLICIES}")
    ev.add_argument("--dataset", action="append", default=None,
                    help="JSONL with {\"turns\": [...]} per line, or the name of a bundled set (gsm8k, humaneval, "
                    "math500, mbpp, mt-bench) (repeatable; default: the five bundled sets)")
    ev.add_argument("--limit", type=positive_int, default=None, help="first N prompts of each dataset")
    ev.add_argument("--max-new-tokens", type=positive_int, default=256, help="(default 256)")
    ev.add_argument("--temperature", type=float, action="append", default=None,
                    help="sampling temperature (repeatable; default 0)")
    ev.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i (default 0)")
    ev.add_argument("--confidence-threshold", type=float, default=None,
                    help="verify drafts only while calibrated prefix survival >= C (drafters with a confidence head)")
    ev.add_argument("--llama-cpp", action="append", default=[], metavar="GGUF",
                    help="also decode plainly with llama.cpp on this GGUF (repeatable; 'embedded' = the embedded "
                    "Q4_1 file, 'embedded-bf16' = a BF16 copy of it made once by llama.cpp's quantiser): decode "
                    "tok/s side by side with dspark's on the same prompts")
    ev.add_argument("--out", required=True, help="output directory")
    target_args(ev, threads=True)
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
    ca.add_argument("--limit", type=positive_int, default=None, help="first N prompts of each dataset")
    ca.add_argument("--max-new-tokens", type=positive_int, default=256, help="(default 256)")
    ca.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    ca.add_argument("--seed", type=int, default=0)
    target_args(ca)
    ca.add_argument("--dry-run", action="store_true", help="report, but do not write the temperatures")
    ca.add_argument("--out", default=None, metavar="DIR",
                    help="write a calibrated copy of the drafter here instead of updating it in place")
    ca.set_defaults(func=cmd_calibrate)


def cmd_eval(args) -> int:
    import torch

    from dspark.eval.evaluate import evaluate
    from dspark.eval.llama_cpp import LlamaCppDecoder, llama_cpp_path
    from dspark.eval.prompts import default_datasets, resolve_dataset
    from dspark.eval.report import write_report
    from dspark.model.loading import parse_dtype
    from dspark.sampling import SamplingParams

    temps = args.temperature or [0.0]
    for t in temps:
        SamplingParams(temperature=t)  # validates
    datasets = [resolve_dataset(d) for d in args.dataset] if args.dataset else default_datasets()
    for d in datasets:
        if not d.is_file():
            names = ", ".join(p.stem for p in default_datasets())
            raise DsparkError(f"dataset {d} does not exist; give a JSONL file or a bundled set's name ({names})")
    check_writable(args.out)
    parse_dtype(args.dtype)
    target = open_target(args)
    peers = [LlamaCppDecoder(llama_cpp_path(spec), torch.get_num_threads()) for spec in args.llama_cpp]
    out = Path(args.out)
    results = evaluate(target, args.drafter, datasets, args.limit, args.max_new_tokens, temps, args.seed,
                       args.confidence_threshold, journal_path=out / "journal.jsonl", peers=peers)
    write_report(results, out)
    print((out / "report.md").read_text())
    return 0


def cmd_calibrate(args) -> int:
    from dspark.draft.checkpoint import convert_drafter, load_drafter_checkpoint, write_temperatures
    from dspark.eval import metrics
    from dspark.eval.calibration import fit_sts, record_full_rounds
    from dspark.eval.prompts import load_eval_prompts
    from dspark.model.loading import parse_dtype
    from dspark.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature)
    if not args.dry_run:
        check_writable(args.out or args.drafter, what="calibrated drafter")
    prompts = [p for d in args.dataset for p in load_eval_prompts(d)[: args.limit]]
    parse_dtype(args.dtype)
    target = open_target(args)
    drafter = load_drafter_checkpoint(args.drafter, target)
    if not drafter.has_confidence:
        raise DsparkError(f"{args.drafter} has no confidence head: nothing to calibrate")
    rounds = record_full_rounds(target, drafter, prompts, args.max_new_tokens, params, args.seed)
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
