"""Online knowledge-distillation trainer (DESIGN.md §4): the loop, validation and logging.

The frozen target runs inside the loop: each step it reads a batch of regenerated conversations,
yields the tapped features and its next-token distributions (`passes.target_pass`), and the drafter
learns from them through the packed block forward (`passes.drafter_pass`). Nothing is cached on disk
but the regenerated text. The data order is `batches.py`'s (a pure function of seed and step), the
resume checkpoint `checkpointing.py`'s. Under torchrun each rank takes every world-th sequence of the
global batch and losses are normalised by the global supervision weight, so the gradient equals the
single-process one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from dspark.draft import vocab
from dspark.draft.checkpoint import init_from_target, load_model, new_draft_config, save_drafter
from dspark.draft.dspark import DSparkModel
from dspark.draft.eagle3 import Eagle3Model
from dspark.errors import DsparkError
from dspark.model.kernels import cpu_has_native_bf16
from dspark.model.loading import DTYPES, load_target
from dspark.train.batches import (
    DataOrder,
    Item,
    data_fingerprint,
    micro_batches,
    slot_weights,
    split_data,
    validation_batches,
)
from dspark.train.checkpointing import load_checkpoint, save_checkpoint
from dspark.train.config import ALL_ANCHORS, COMPILE_LOSS_STEPS, DEFAULT_LOSS, TrainConfig
from dspark.train.interrupt import StopRequest
from dspark.train.losses import (
    LossSums,
    acceptance_sums,
    compiled_dense_loss,
    expected_tau,
    greedy_acceptance_sums,
    kd_loss_sums,
    position_weights,
    step_weights,
)
from dspark.train.passes import DrafterPass, TargetPass, clock, drafter_pass, target_pass
from dspark.util.files import atomic_write_text
from dspark.util.journal import read_records


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_frac of the steps, then cosine decay to 0."""
    warm = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False, progress: bool = True, lead: "Trainer | None" = None):
        """`lead`: a trainer of the same data and target whose target and samples this one shares
        (`JointTrainer`)."""
        self.cfg = cfg.validate()
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.out = Path(cfg.out).expanduser()
        self.progress = progress and self.rank == 0
        if cfg.batch_size % self.world:
            raise DsparkError(f"batch_size {cfg.batch_size} must be a multiple of the {self.world} processes")

        self.device = training_device(cfg.device)
        on_cpu = self.device.type == "cpu"
        native_bf16 = cpu_has_native_bf16() if on_cpu else torch.cuda.is_bf16_supported()
        if lead is not None:
            self.target, self.train_set, self.val_set = lead.target, lead.train_set, lead.val_set
        else:
            self.target = load_target(cfg.target or None, dtype=teacher_dtype(cfg.target_dtype, native_bf16),
                                      pack=on_cpu, require_tokenizer=False)
            self.train_set, self.val_set = split_data(cfg, self.target.cfg.vocab_size)
        self.order = DataOrder(cfg, self.train_set)

        self.model = self._build_model().to(self.device)
        if getattr(self.model, "confidence_head", None) is not None:
            self.model.confidence_head.detach_inputs = not self.cfg.conf_into_backbone
        self.target.model.to(self.device)
        self.taps = tuple(self.model.cfg.target_layer_ids)
        self.slots = self.model.train_slots  # predictions per anchor: block slots or TTT steps
        if cfg.algorithm == "eagle3":
            self.weights_k = step_weights(self.slots, cfg.ttt_decay)
        else:
            self.weights_k = position_weights(self.slots, cfg.position_decay)
        self.weights_k = self.weights_k.to(self.device)
        self.autocast = cfg.autocast == "bf16" or (cfg.autocast == "auto" and native_bf16)
        compile_loss = cfg.compile_loss == "on" or (cfg.compile_loss == "auto" and cfg.steps >= COMPILE_LOSS_STEPS)
        self.dense_loss = compiled_dense_loss() if compile_loss else None  # None: eager
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.step = 0
        self.stopped = False  # by a stop request (SIGINT / SIGTERM), checkpointed, before `steps`
        self._open_run(resume)
        if self.world == 1:
            self.ddp = self.model
        else:
            ids = None if on_cpu else [self.device.index]
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)

    # ---- setup ---------------------------------------------------------------------------
    def _open_run(self, resume: bool) -> None:
        """Continue the run in `out` (`resume`), or check that `out` holds none."""
        ckpt = self.out / "checkpoint"
        if not ckpt.exists() and (self.out / "final").exists():  # finished: its resume checkpoint removed
            raise DsparkError(f"{self.out} holds a finished training run (final/ is its drafter) without a resume "
                              "checkpoint; choose another `out` to train again")
        if resume:
            if not ckpt.is_dir():
                raise DsparkError(f"--resume: no checkpoint in {self.out} (expected {ckpt})")
            self.step = load_checkpoint(ckpt, self.cfg, self.model, self.optimizer, self.target,
                                        data_fingerprint(self.train_set))
        elif ckpt.exists():
            raise DsparkError(f"{self.out} already holds a training run; pass --resume to continue it, "
                              "or choose another `out`")

    def _build_model(self):
        c = self.cfg
        eagle = c.algorithm == "eagle3"
        if c.init:
            model, _ = load_model(c.init, self.target)
            if (model.cfg.kind == "eagle3") != eagle:
                raise DsparkError(f"init drafter {c.init} is a {model.cfg.kind} drafter, not {c.algorithm}")
            if c.draft_vocab_size and c.draft_vocab_size != model.cfg.draft_vocab_size:
                raise DsparkError(f"draft_vocab_size {c.draft_vocab_size} differs from the init drafter's "
                                  f"({model.cfg.draft_vocab_size or 'full'}); drop one of them")
        elif eagle:
            torch.manual_seed(c.seed)
            model = Eagle3Model(new_draft_config(
                self.target, kind="eagle3", block_size=c.block_size, target_layer_ids=c.tap_layers or None,
                mask_token_id=None if c.mask_token_id < 0 else c.mask_token_id, num_anchors=self._num_anchors,
                draft_vocab_size=c.draft_vocab_size))
            init_from_target(model, self.target, c.copy_target_layers)
            self._pick_draft_vocab(model)
        if eagle:
            model.ttt_steps = c.ttt_steps
        if c.init or eagle:
            return model.float().requires_grad_(True).train()
        dspark = c.algorithm == "dspark"
        cfg = new_draft_config(
            self.target,
            block_size=c.block_size,
            num_hidden_layers=c.layers,
            target_layer_ids=c.tap_layers or None,
            markov_head_type=c.head if dspark else "none",
            markov_rank=c.markov_rank,
            enable_confidence_head=dspark and c.confidence_head,
            confidence_head_with_markov=dspark and c.confidence_head and c.confidence_head_with_markov,
            mask_token_id=None if c.mask_token_id < 0 else c.mask_token_id,
            num_anchors=self._num_anchors,
            draft_layer=c.draft_layer,
            draft_vocab_size=c.draft_vocab_size,
            context_fusion=c.context_fusion,
        )
        torch.manual_seed(c.seed)
        model = DSparkModel(cfg)
        init_from_target(model, self.target, c.copy_target_layers)
        self._pick_draft_vocab(model)
        return model.train()

    @property
    def _num_anchors(self) -> int:
        """What the checkpoint records as anchors per sequence (DeepSpec's field; "all": max_seq_len)."""
        c = self.cfg
        return c.max_seq_len if c.anchors_per_seq == ALL_ANCHORS else c.anchors_per_seq

    def _pick_draft_vocab(self, model) -> None:
        """A fresh drafter with a reduced vocabulary drafts over the training replies' top-K tokens."""
        k = model.cfg.draft_vocab_size
        if not k:
            return
        replies = [s.response_ids for s in self.train_set]
        model.set_draft_vocab(vocab.most_frequent(replies, k, self.target.cfg.vocab_size))
        if self.rank == 0:
            val = vocab.coverage([s.response_ids for s in self.val_set], model.draft_ids)
            print(f"[dspark] draft vocabulary: {k} of {self.target.cfg.vocab_size} tokens; coverage of the "
                  f"response tokens {vocab.coverage(replies, model.draft_ids):.1%} (train), {val:.1%} (validation)",
                  file=sys.stderr, flush=True)

    # ---- the passes ----------------------------------------------------------------------
    def step_items(self, step: int) -> list[list[Item]]:
        """This rank's micro-batches of step `step`."""
        return micro_batches(self.order.global_batch(step), self.rank, self.world, self.cfg.grad_accum)

    def target_pass(self, items: list[Item], taps: tuple[int, ...] | None = None,
                    slots: int | None = None) -> TargetPass:
        """The frozen target's pass over a micro-batch, once; `drafter_pass` then takes its anchors chunk
        by chunk. `taps` / `slots` (default: this drafter's) may be supersets, for several drafters at
        once (`TargetPass.view` takes each one's part)."""
        return target_pass(self.target.model, items, self.taps if taps is None else tuple(taps),
                           self.slots if slots is None else slots, self.cfg.max_seq_len, self.device, self._draft_ids)

    def anchor_spans(self, t: TargetPass) -> list[tuple[int, int]]:
        return t.anchor_spans(self.cfg.anchor_chunk)

    def drafter_pass(self, t: TargetPass, span: tuple[int, int], model: torch.nn.Module | None = None) -> DrafterPass:
        """The drafter's (`model`: default this trainer's, as DDP wraps it) pass over anchors [span)."""
        return drafter_pass(t, self.ddp if model is None else model, self.target.model, span, self.weights_k,
                            self.autocast)

    def loss_sums(self, o: DrafterPass) -> LossSums:
        c, sup = self.cfg, o.sup
        conf = o.conf[sup] if o.conf is not None else None
        kind = DEFAULT_LOSS[c.algorithm] if c.loss == "auto" else c.loss
        ce, tv = {"kd": (c.ce_weight, c.tv_weight), "ce": (1.0, 0.0), "soft_ce": (0.0, 0.0)}[kind]
        return kd_loss_sums(o.logits[sup], conf, o.target, o.labels[sup], o.w[sup], ce, tv, c.conf_weight,
                            soft_ce_weight=1.0 if kind == "soft_ce" else 0.0, draft_ids=self._draft_ids,
                            dense=self.dense_loss)

    @property
    def _draft_ids(self) -> torch.Tensor | None:
        """The drafter's vocabulary (target ids, on the device), None for the full one."""
        ids = self.model.draft_ids
        return None if ids is None else ids.to(self.device)

    # ---- training ------------------------------------------------------------------------
    def train_step(self, targets: list[TargetPass] | None = None) -> dict:
        """One optimiser step. `targets`: the target's passes over this step's micro-batches, already
        computed (shared by several drafters); their time is then reported, not spent here."""
        t0 = time.perf_counter()
        items = self.order.global_batch(self.step)
        total_w = slot_weights(items, self.weights_k.tolist(), self.slots, self.cfg.max_seq_len)
        chunks = micro_batches(items, self.rank, self.world, self.cfg.grad_accum)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        sums = torch.zeros(4, dtype=torch.float64)
        counts = torch.zeros(3, dtype=torch.float64)  # tokens, blocks, supervised slots
        target_s = 0.0
        t_batches = clock(self.device)
        for i, chunk in enumerate(chunks):
            t = self.target_pass(chunk) if targets is None else targets[i].view(self.taps, self.slots)
            counts += torch.tensor([t.tokens, t.blocks, 0], dtype=torch.float64)
            target_s += t.seconds
            spans = self.anchor_spans(t)
            for j, span in enumerate(spans):
                last = i == len(chunks) - 1 and j == len(spans) - 1  # DDP all-reduces on the last backward only
                with contextlib.nullcontext() if last or self.world == 1 else self.ddp.no_sync():
                    o = self.drafter_pass(t, span)
                    ls = self.loss_sums(o)
                    if total_w > 0:
                        (ls.total * (self.world / total_w)).backward()
                sums += _as_row(ls)
                counts[2] += int(o.sup.sum())
        t_optimizer = clock(self.device)
        if self.world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(counts)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        t_end = clock(self.device)
        dt = t_end - t0 + (target_s if targets is not None else 0.0)
        m = (sums / max(total_w, 1e-12)).tolist()
        return {"step": self.step, "lr": lr_at(self.step - 1, self.cfg), "loss": m[0], "ce": m[1], "tv": m[2],
                "conf": m[3], "grad_norm": float(grad_norm), "seconds": dt,
                # where the step's time went: the frozen target's forward, the drafter's forward and
                # backward (losses included), and the optimiser (all-reduce, clipping, AdamW)
                "target_s": target_s, "drafter_s": t_optimizer - t_batches - (target_s if targets is None else 0.0),
                "optimizer_s": t_end - t_optimizer,
                "blocks_per_s": counts[1].item() / dt, "target_tok_per_s": counts[0].item() / dt,
                "slots": int(counts[2].item()), "slots_per_s": counts[2].item() / dt}  # supervised draft slots

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss terms and per-position acceptance α_k on the validation set (fixed anchors): at T = 1
        (1 − TV) and at T = 0 (`alpha_greedy`: the draft's argmax is the target's), each conditional
        on the true prefix."""
        if not self.val_set:
            return {}
        g = self.slots
        self.model.eval()
        sums = torch.zeros(4, dtype=torch.float64)
        a_sum, a_cnt, greedy = (torch.zeros(g, dtype=torch.float64) for _ in range(3))
        total_w = 0.0
        for items in validation_batches(self.cfg, self.val_set, max(1, self.cfg.batch_size // self.world)):
            t = self.target_pass(items)
            for span in self.anchor_spans(t):
                o = self.drafter_pass(t, span, self.model)
                sums += _as_row(self.loss_sums(o))
                total_w += float(o.w.sum())
                logits, block_pos = o.logits[o.sup], torch.arange(g, device=self.device).expand_as(o.sup)[o.sup]
                s_, c_ = acceptance_sums(logits, o.target, block_pos, g, self._draft_ids)
                a_sum += s_.cpu()
                a_cnt += c_.cpu()
                greedy += greedy_acceptance_sums(logits, o.target, block_pos, g, self._draft_ids).cpu()
        self.model.train()
        alpha = (a_sum / a_cnt.clamp(min=1)).tolist()
        alpha_greedy = (greedy / a_cnt.clamp(min=1)).tolist()
        m = (sums / max(total_w, 1e-12)).tolist()
        return {"loss": m[0], "ce": m[1], "tv": m[2], "conf": m[3], "alpha": alpha, "expected_tau": expected_tau(alpha),
                "alpha_greedy": alpha_greedy, "expected_tau_greedy": expected_tau(alpha_greedy)}

    def save_checkpoint(self) -> None:
        if self.rank == 0:
            state = {"step": self.step, "config": self.cfg.to_dict(), "world_size": self.world,
                     "data_fingerprint": data_fingerprint(self.train_set)}
            save_checkpoint(self.out / "checkpoint", self.cfg, self.model, self.optimizer, self.target, state)
        if self.world > 1:
            dist.barrier()

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> dict:
        """Train to `steps`, validating, checkpointing and logging; returns the last validation."""
        self.open_log()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="training", unit="step", disable=not self.progress)
        last_val = self.validate_and_log() if self.step == 0 else {}
        try:
            with StopRequest(self.world, self.device) as stop:
                while self.step < self.cfg.steps:
                    rec = self.train_step()
                    self.log(rec)
                    last_val = self.after_step() or last_val
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{last_val.get('expected_tau', 0):.2f}")
                    if self.step < self.cfg.steps and stop.agreed():
                        self.stop_here()
                        break
        finally:
            bar.close()
            self.close_log()
        if not self.stopped:
            self.finish()
        return last_val

    # the loop's parts, shared with JointTrainer
    def open_log(self) -> None:
        log_path = self.out / "log.jsonl"
        self._log_file = None
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.step == 0:
                log_path.unlink(missing_ok=True)  # a run killed before its first checkpoint restarts
            _truncate_log(log_path, self.step)
            (self.out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
            self._log_file = open(log_path, "a")

    def log(self, rec: dict) -> None:
        if self._log_file is not None:
            self._log_file.write(json.dumps(rec) + "\n")
            self._log_file.flush()

    def close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def after_step(self) -> dict | None:
        """Validation and checkpoint when due; the validation, if one ran."""
        c, val = self.cfg, None
        if self.step % c.eval_every == 0 or self.step == c.steps:
            val = self.validate_and_log()
        if self.step % c.checkpoint_every == 0 or self.step == c.steps:
            self.save_checkpoint()
        return val

    def stop_here(self) -> None:
        """A stop request: checkpoint this step (unless `after_step` just did) and mark the run stopped."""
        if self.step % self.cfg.checkpoint_every:
            self.save_checkpoint()
        self.plot_curves()
        self.stopped = True

    def validate_and_log(self) -> dict:
        val = self.validate() if self.rank == 0 else {}
        if val:
            self.log({"step": self.step, "val": val})
        if self.world > 1:
            dist.barrier()
        return val

    def finish(self) -> None:
        if self.rank == 0:
            save_drafter(self.model, self.out / "final", target=self.target)
        self.plot_curves()

    def plot_curves(self) -> None:
        """OUT/curves.png from the log so far (at the end of a run, and where a stopped run stands)."""
        if self.rank == 0:
            from dspark.train.plot import plot_training

            plot_training(self.out / "log.jsonl", self.out / "curves.png")


def _as_row(ls: LossSums) -> torch.Tensor:
    return torch.tensor([ls.total.item(), ls.ce.item(), ls.tv.item(), ls.conf.item()], dtype=torch.float64)


def training_device(name: str) -> torch.device:
    """`auto`: this rank's CUDA GPU when one is visible (LOCAL_RANK under torchrun), else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def teacher_dtype(name: str, native_bf16: bool) -> torch.dtype:
    """The frozen target's precision for `target_dtype` ("auto": bf16 where the device runs it natively)."""
    if name == "auto":
        return torch.bfloat16 if native_bf16 else torch.float32
    return DTYPES[name]


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records of steps after the checkpoint being resumed (that work was lost)."""
    if not path.exists():
        return
    records, _ = read_records(path)
    keep = [r for r in records if isinstance(r, dict) and r.get("step", step + 1) <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
