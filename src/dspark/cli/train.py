"""`dspark train`: online distillation of a drafter."""

from __future__ import annotations

from dspark.cli.common import positive_int
from dspark.util.files import check_writable


def add_parsers(sub) -> None:
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
    tr.add_argument("--steps", type=positive_int, default=None, help="total optimiser steps (overrides the config)")
    tr.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=cmd_train)


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
