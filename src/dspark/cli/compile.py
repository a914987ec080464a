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
        "takes about a second. Commands with --runner auto (the default) use it from then on.",
    )
    target_args(p, dtype=False, threads=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "int8"), help=(
        "how the projections' weights are stored: bfloat16 (default; `--dtype bfloat16` / `auto` use it) or "
        "int8 weight-only, one scale per output channel (half the bytes; `--dtype int8` uses it)"))
    p.add_argument("--force", action="store_true", help="compile again even if this machine's runner exists")
    p.set_defaults(func=cmd_compile)


def cmd_compile(args) -> int:
    import json
    import time

    import torch

    from dspark.model.compiled import artifact_dir, compile_runner

    target = open_target(args, dtype=torch.bfloat16, pack=False, runner="eager", require_tokenizer=False)
    weights = "int8" if args.dtype == "int8" else "bf16"
    out = artifact_dir(target.path, weights)
    if (out / "meta.json").is_file() and not args.force:
        print(f"already compiled for this machine: {out} (--force to build again)")
        return 0
    started = time.perf_counter()
    say = lambda text: print(f"[{time.perf_counter() - started:6.1f} s] {text}", flush=True)
    compile_runner(target.model, target.path, weights, say=say)
    meta = json.loads((out / "meta.json").read_text())
    use = "--dtype int8 uses it" if weights == "int8" else "--runner auto uses it from now on"
    say(f"done: {out} ({meta['bytes'] / 2**20:.0f} MiB); {use}")
    return 0
