"""`dspark compile`: build this machine's compiled runner for a target (model/compiled.py)."""

from __future__ import annotations

from dspark.cli.common import open_target, target_args


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "compile",
        help="build the compiled bf16 runner for this machine (once; `generate`, `profile` and `eval` then use it)",
        description="Export the target's decode step and LM head with torch.export and compile them with "
        "AOTInductor (frozen weights; Inductor's C++ GEMM templates timed on this CPU, or oneDNN's prepacked "
        "products where they measured faster: bf16 on AVX512-BF16 CPUs without AMX) into the dspark cache, "
        "keyed by model, CPU flags, thread count and torch version. Takes a few minutes; loading the result "
        "takes about a second. Then times it against the eager runner: commands with --runner auto (the default) "
        "use it from then on where it measured faster (not on AVX2-only CPUs, whose bf16 has no native "
        "instructions: there --dtype auto runs float32 eager anyway).",
    )
    target_args(p, dtype=False, threads=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "int8"), help=(
        "how the projections' weights are stored: bfloat16 (default; `--dtype bfloat16` / `auto` use it) or "
        "int8 weight-only, one scale per output channel (half the bytes; `--dtype int8` uses it)"))
    p.add_argument("--force", action="store_true", help="compile again even if this machine's runner exists")
    p.set_defaults(func=cmd_compile)


def cmd_compile(args) -> int:
    import time

    import torch

    from dspark.model.compiled import (
        artifact_dir,
        compile_runner,
        faster_than_eager,
        read_meta,
        record_exact_rows,
        runner_built,
    )

    target = open_target(args, dtype=torch.bfloat16, pack=False, runner="eager", require_tokenizer=False)
    weights, model_dir = ("int8" if args.dtype == "int8" else "bf16"), target.path
    out = artifact_dir(model_dir, weights)
    started = time.perf_counter()
    say = lambda text: print(f"[{time.perf_counter() - started:6.1f} s] {text}", flush=True)
    if runner_built(model_dir, weights) and not args.force:
        print(f"already compiled for this machine: {out} (--force to build again)")
        if "exact_rows" not in read_meta(model_dir, weights):  # built by an earlier dspark: measure what it did not
            say(f"{record_exact_rows(model_dir, weights, target.cfg, say)} rows of a call compute exactly")
        if faster_than_eager(model_dir, weights) is None:
            _time_against_eager(args, weights, say)
        return 0
    compile_runner(target.model, model_dir, weights, say=say)
    del target
    meta = read_meta(model_dir, weights)
    say(f"done: {out} ({meta['bytes'] / 2**20:.0f} MiB; {meta['exact_rows']} rows of a call compute exactly)")
    _time_against_eager(args, weights, say)
    return 0


def _time_against_eager(args, weights: str, say) -> None:
    """Time a 1-token and a ROWS-token forward with logits (after up to 256 tokens) of the compiled runner
    against the eager bf16 one, alternating three times (medians), record the verdict and say what
    `--runner auto` / `--dtype` will do with it."""
    import statistics

    import torch

    from dspark.model.compiled import ROWS, record_timing
    from dspark.model.loading import default_dtype
    from dspark.schedule.sps import fit_context, measure_sps

    say("timing it against the eager runner (about a minute)")
    dtype = "int8" if weights == "int8" else torch.bfloat16
    targets = {"eager": open_target(args, dtype=torch.bfloat16, runner="eager", require_tokenizer=False),
               "compiled": open_target(args, dtype=dtype, runner="compiled", require_tokenizer=False)}
    runs: dict[str, list] = {name: [] for name in targets}
    for _ in range(3):
        for name, target in targets.items():
            context = fit_context(target, 256, ROWS)
            runs[name].append(measure_sps(target, max_tokens=ROWS, context=context, reps=3, progress=False))
    ms = {name: {k: statistics.median(1e3 / t.values[k - 1] for t in tables) for k in (1, ROWS)}
          for name, tables in runs.items()}
    faster = record_timing(targets["eager"].path, weights, ms)
    c, e = ms["compiled"], ms["eager"]
    timing = f"a 1 / {ROWS}-token forward {c[1]:.1f} / {c[ROWS]:.1f} ms compiled, {e[1]:.1f} / {e[ROWS]:.1f} ms eager bf16"
    if weights == "int8":
        say(f"{timing}; --dtype int8 uses it")
    elif not faster:
        say(f"{timing}: slower on this CPU, so --runner auto keeps the eager runner (--runner compiled forces it)")
    elif default_dtype() != torch.bfloat16:
        say(f"{timing}; --dtype bfloat16 uses it (--dtype auto runs eager, without bf16, on this CPU)")
    else:
        say(f"{timing}; --runner auto uses it from now on")
