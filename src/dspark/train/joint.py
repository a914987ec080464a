"""Several drafters distilled on the same batches from one frozen-target pass per micro-batch.

The target's forward (its hidden states at every tap any drafter reads, and its distribution at every
position any drafter supervises) is most of a step's cost; drafters trained on the same data, seed,
batches and anchors can share it instead of paying it once each. Each drafter keeps its own run
directory, optimiser, checkpoint, log and validation, exactly as if it were trained alone: the
shared pass is the one each would have computed (its taps and slots are a subset), so a joint run
follows each drafter's solo run step for step.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from dspark.errors import DsparkError
from dspark.train.config import TrainConfig
from dspark.train.interrupt import StopRequest
from dspark.train.trainer import Trainer

# what decides the batches, anchors and target outputs: drafters sharing a pass must agree on them
SHARED_OPTIONS = ("data", "val_data", "target", "target_dtype", "seed", "steps", "batch_size", "grad_accum", "anchors_per_seq",
                  "max_seq_len", "group_by_length", "val_fraction", "val_max_samples", "draft_vocab_size", "device",
                  "threads", "checkpoint_every")


class JointTrainer:
    def __init__(self, cfgs: list[TrainConfig], resume: bool = False, progress: bool = True):
        if len(cfgs) < 2:
            raise DsparkError("joint training needs two or more configs")
        for c in cfgs[1:]:
            diff = [f"{k}: {getattr(cfgs[0], k)!r} vs {getattr(c, k)!r}" for k in SHARED_OPTIONS
                    if getattr(cfgs[0], k) != getattr(c, k)]
            if diff:
                raise DsparkError(f"cannot train {c.out} together with {cfgs[0].out}: drafters sharing the target's "
                                  f"pass need the same {', '.join(diff)}")
        outs = [c.out for c in cfgs]
        if len(set(outs)) != len(outs):
            raise DsparkError(f"each drafter needs its own run directory; got {outs}")
        lead = Trainer(cfgs[0], resume=resume, progress=False)
        self.trainers = [lead] + [Trainer(c, resume=resume, progress=False, lead=lead) for c in cfgs[1:]]
        steps = {t.step for t in self.trainers}
        if len(steps) > 1:
            raise DsparkError(f"the runs were checkpointed at different steps ({sorted(steps)}); resume each alone "
                              "up to the same step, or start over")
        if any(not _same_ids(t.model.draft_ids, lead.model.draft_ids) for t in self.trainers):
            raise DsparkError("the drafters draft over different vocabularies; a shared pass needs the same one")
        self.taps = tuple(sorted({x for t in self.trainers for x in t.taps}))
        self.slots = max(t.slots for t in self.trainers)
        self.progress = progress and lead.rank == 0

    @property
    def step(self) -> int:
        return self.trainers[0].step

    def train_step(self) -> list[dict]:
        lead = self.trainers[0]
        t0 = time.perf_counter()
        targets = [lead.target_pass(chunk, self.taps, self.slots) for chunk in lead.step_items(self.step)]
        recs = [t.train_step(targets) for t in self.trainers]
        step_s = time.perf_counter() - t0
        for r in recs:
            r["target_shared_by"], r["joint_seconds"] = len(self.trainers), step_s
        return recs

    def run(self) -> list[dict]:
        """Train every drafter to `steps`; returns each one's last validation."""
        steps = self.trainers[0].cfg.steps
        for t in self.trainers:
            t.open_log()
        bar = tqdm(total=steps, initial=self.step, desc=f"training {len(self.trainers)} drafters", unit="step",
                   disable=not self.progress)
        last = [t.validate_and_log() if t.step == 0 else {} for t in self.trainers]
        lead = self.trainers[0]
        try:
            with StopRequest(lead.world, lead.device) as stop:
                while self.step < steps:
                    for i, (t, rec) in enumerate(zip(self.trainers, self.train_step())):
                        t.log(rec)
                        last[i] = t.after_step() or last[i]
                    bar.update(1)
                    bar.set_postfix(tau=" ".join(f"{v.get('expected_tau', 0):.2f}" for v in last))
                    if self.step < steps and stop.agreed():
                        for t in self.trainers:
                            t.stop_here()
                        break
        finally:
            bar.close()
            for t in self.trainers:
                t.close_log()
        if not lead.stopped:
            for t in self.trainers:
                t.finish()
        return last


def _same_ids(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a.cpu(), b.cpu()))
