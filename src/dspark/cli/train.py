"""`dspark train`: online distillation of a drafter."""

from __future__ import annotations

import json
import sys

from dspark.cli.common import positive_int
from dspark.util.files import check_writable


def add_parsers(sub) -> None:
    tr = sub.add_parser(
        "train",
        help="train a drafter by online distillation from the target",
        description="Train a DSpark (or DFlash / EAGLE-3) drafter by online knowledge distillation: the frozen "
        "target runs inside the loop on regenerated data. Checkpoints go to OUT/checkpoint (atomically); "
        "--resume continues exactly where the last one left off; Ctrl-C or SIGTERM stops after the current step "
        "with a checkpoint (a second one at once). Runs under `torchrun --nproc_per_node N` "
        "with DistributedDataParallel. Writes OUT/log.jsonl, OUT/curves.png and OUT/final.",
    )
    tr.add_argument("--config", action="append", default=None,
                    help="TOML or YAML file of training options; repeat it to train several drafters on the same "
                    "batches, sharing one target pass per step (same data, seed, steps, batch and anchors)")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override an option (repeatable), e.g. --set steps=200 --set lr=3e-4")
    tr.add_argument("--data", action="append", default=None, help=(
        "regenerated data, a JSONL file or a shard store; repeat it to train on several together, e.g. a second "
        "reply per prompt (overrides the config's `data`)"))
    tr.add_argument("--out", default=None, help="run directory (overrides the config)")
    tr.add_argument("--steps", type=positive_int, default=None, help="total optimiser steps (overrides the config)")
    tr.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from dspark.errors import DsparkError
    from dspark.train.config import load_config
    from dspark.train.trainer import Trainer

    configs = args.config or [None]
    if len(configs) > 1 and args.out is not None:
        raise DsparkError("--out names one run directory; with several --config set `out` in each file")
    overrides = list(args.set)
    if args.data:
        overrides.append(f"data={json.dumps(args.data)}")
    for key in ("out", "steps"):
        if getattr(args, key) is not None:
            overrides.append(f"{key}={getattr(args, key)}")
    cfgs = [load_config(path, overrides) for path in configs]
    for cfg in cfgs:
        check_writable(cfg.out, what="run directory")
    if len(cfgs) == 1:
        trainer = Trainer(cfgs[0], resume=args.resume, progress=not args.no_progress)
        trainers, vals = [trainer], [trainer.run()]
    else:
        from dspark.train.joint import JointTrainer

        joint = JointTrainer(cfgs, resume=args.resume, progress=not args.no_progress)
        trainers, vals = joint.trainers, joint.run()
    if trainers[0].stopped:
        if trainers[0].rank == 0:
            runs = ", ".join(str(t.out / "checkpoint") for t in trainers)
            print(f"stopped at step {trainers[0].step} of {trainers[0].cfg.steps}; checkpoint in {runs}; "
                  "continue with the same command and --resume", file=sys.stderr)
        return 130
    if trainers[0].rank == 0:
        for trainer, val in zip(trainers, vals):
            tau = f", validation expected tau {val['expected_tau']:.3f}" if val else ""
            print(f"trained {trainer.cfg.steps} steps -> {trainer.out / 'final'}{tau}")
    return 0
