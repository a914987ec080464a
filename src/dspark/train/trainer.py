"""Online knowledge-distillation trainer (DESIGN.md §4).

The frozen target runs inside the loop: each step it reads a batch of regenerated conversations,
yields the tapped features and its next-token distributions, and the drafter learns from them
through the packed block forward. Nothing is cached on disk but the regenerated text.

Determinism is by construction: the data order of step s and the anchors of each sequence are
pure functions of (seed, s), so a resumed or a multi-process run sees exactly what an
uninterrupted single-process run sees. Under torchrun each rank takes every world-th sequence of
the global batch and losses are normalised by the global supervision weight, so the gradient
equals the single-process one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dspark.draft import vocab
from dspark.draft.checkpoint import init_from_target, load_model, new_draft_config, save_drafter
from dspark.draft.dspark import DSparkModel
from dspark.draft.eagle3 import Eagle3Model
from dspark.errors import DsparkError
from dspark.target.kernels import cpu_has_native_bf16
from dspark.target.loading import load_target
from dspark.train.config import ALL_ANCHORS, CHECKPOINT_DTYPES, TrainConfig
from dspark.train.data import Sample, is_validation, load_samples
from dspark.train.losses import (
    TargetDist,
    acceptance_sums,
    expected_tau,
    greedy_acceptance_sums,
    kd_loss_sums,
    position_weights,
    step_weights,
)
from dspark.train.stopping import StopRequest
from dspark.util.files import atomic_directory, atomic_write_text
from dspark.util.journal import read_records
from dspark.util.seeding import derived_generator

# Options a resumed run may change; anything else must match the checkpoint.
RESUMABLE_CHANGES = {"steps", "checkpoint_every", "eval_every", "threads", "out", "device", "anchor_chunk",
                     "val_data", "val_max_samples", "checkpoint_dtype"}
# what runs saved before an option existed had
ADDED_OPTIONS = {"draft_layer": "target", "confidence_head_with_markov": True, "draft_vocab_size": 0, "anchor_chunk": 64,
                 "val_data": "", "checkpoint_dtype": "float32"}
GROUP_STEPS = 16  # group_by_length sorts this many steps' sequences at a time


def sample_anchors(sample: Sample, max_seq_len: int, count: int | str, gen: torch.Generator) -> list[int]:
    """Up to `count` distinct anchors p with p and p+1 both response tokens (within max_seq_len);
    `count` "all": every such p."""
    n = min(len(sample.prompt_ids) + len(sample.response_ids), max_seq_len)
    lo, hi = len(sample.prompt_ids), n - 2  # inclusive range of valid anchors
    if hi < lo:
        return []
    if count == ALL_ANCHORS:
        return list(range(lo, hi + 1))
    valid = hi - lo + 1
    pick = torch.randperm(valid, generator=gen)[:count]
    return sorted((lo + pick).tolist())


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
        if lead is not None:
            self.target, self.train_set, self.val_set = lead.target, lead.train_set, lead.val_set
        else:
            self.target = load_target(cfg.target or None, dtype=torch.float32, pack=on_cpu, require_tokenizer=False)
            self._split_data()

        self.model = self._build_model().to(self.device)
        self.target.model.to(self.device)
        self.taps = tuple(self.model.cfg.target_layer_ids)
        self.slots = self.model.train_slots  # predictions per anchor: block slots or TTT steps
        if cfg.algorithm == "eagle3":
            self.weights_k = step_weights(self.slots, cfg.ttt_decay)
        else:
            self.weights_k = position_weights(self.slots, cfg.position_decay)
        self.weights_k = self.weights_k.to(self.device)
        native_bf16 = cpu_has_native_bf16() if on_cpu else torch.cuda.is_bf16_supported()
        self.autocast = cfg.autocast == "bf16" or (cfg.autocast == "auto" and native_bf16)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.step = 0
        self.stopped = False  # by a stop request (SIGINT / SIGTERM), checkpointed, before `steps`
        self._perm_epoch: int | None = None  # data order of the current epoch, cached
        ckpt = self.out / "checkpoint"
        finished = not ckpt.exists() and (self.out / "final").exists()  # its resume checkpoint removed
        if finished:
            raise DsparkError(f"{self.out} holds a finished training run (final/ is its drafter) without a resume "
                              "checkpoint; choose another `out` to train again")
        if resume:
            if not ckpt.is_dir():
                raise DsparkError(f"--resume: no checkpoint in {self.out} (expected {ckpt})")
            self._load_checkpoint(ckpt)
        elif ckpt.exists():
            raise DsparkError(f"{self.out} already holds a training run; pass --resume to continue it, "
                              "or choose another `out`")
        if self.world == 1:
            self.ddp = self.model
        else:
            ids = None if on_cpu else [self.device.index]
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)

    # ---- setup ---------------------------------------------------------------------------
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

    # ---- data ----------------------------------------------------------------------------
    def global_batch(self, step: int) -> list[tuple[Sample, list[int]]]:
        """The step's sequences (same on every rank) with their anchors."""
        n, B = len(self.train_set), self.cfg.batch_size
        out = []
        for i in range(B):
            pos = step * B + i
            epoch, j = divmod(pos, n)
            perm = self._perm(epoch)
            s = self.train_set[int(perm[j])]
            out.append((s, sample_anchors(s, self.cfg.max_seq_len, self.cfg.anchors_per_seq,
                                          derived_generator(self.cfg.seed, "anchors", step, i))))
        return out

    def _perm(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            gen = derived_generator(self.cfg.seed, "epoch", epoch)
            perm = torch.randperm(len(self.train_set), generator=gen)
            if self.cfg.group_by_length:
                perm = self._group_by_length(perm, gen)
            self._perm_cache, self._perm_epoch = perm, epoch
        return self._perm_cache

    def _group_by_length(self, perm: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Within mega-batches of GROUP_STEPS steps, batch sequences of similar length together (less
        padding in the target's forward), then shuffle the batches."""
        B, c = self.cfg.batch_size, self.cfg.max_seq_len
        length = lambda i: min(len(self.train_set[i].prompt_ids) + len(self.train_set[i].response_ids), c)  # noqa: E731
        out = []
        for start in range(0, len(perm), B * GROUP_STEPS):
            chunk = sorted(perm[start : start + B * GROUP_STEPS].tolist(), key=length, reverse=True)
            batches = [chunk[i : i + B] for i in range(0, len(chunk), B)]
            out += [x for k in torch.randperm(len(batches), generator=gen).tolist() for x in batches[k]]
        return torch.tensor(out)

    def _slot_weights(self, items) -> float:
        """Σ w_k over supervised slots of a list of (sample, anchors)."""
        total = 0.0
        w = self.weights_k.tolist()
        for s, anchors in items:
            n = min(len(s.prompt_ids) + len(s.response_ids), self.cfg.max_seq_len)
            for p in anchors:
                total += sum(w[: min(self.slots, n - 1 - p)])
        return total

    def _split_data(self) -> None:
        cfg = self.cfg
        keep = self._load_data(cfg.data)
        self.train_set = [s for s in keep if not is_validation(s.id, cfg.val_fraction)]
        self.val_set = [s for s in keep if is_validation(s.id, cfg.val_fraction)]
        if cfg.val_data:
            self.val_set = self._load_data(cfg.val_data)
            held_out = {s.id for s in self.val_set}
            self.train_set = [s for s in self.train_set if s.id not in held_out]
        self.val_set = self.val_set[: cfg.val_max_samples]
        if not self.train_set:
            raise DsparkError(f"{cfg.data}: no training samples left after the validation split")

    def _load_data(self, path: str) -> list[Sample]:
        keep = [s for s in load_samples(path) if len(s.prompt_ids) <= self.cfg.max_seq_len - 2]
        vocab = self.target.cfg.vocab_size
        for s in keep[:50]:  # cheap sanity check that the data was made by this target's tokenizer
            if max(s.prompt_ids + s.response_ids) >= vocab:
                raise DsparkError(f"{path}: token ids exceed the target's vocabulary ({vocab}); "
                                  "was it regenerated with another target?")
        return keep

    def data_fingerprint(self) -> str:
        """Identifies the training samples (ids, lengths, split): resuming on other data is refused."""
        h = hashlib.sha256()
        for s in self.train_set:
            h.update(f"{s.id}:{len(s.prompt_ids)}:{len(s.response_ids)};".encode())
        return f"{len(self.train_set)}:{h.hexdigest()[:16]}"

    # ---- forward -------------------------------------------------------------------------
    def target_outputs(self, items, taps: tuple[int, ...] | None = None, slots: int | None = None) -> dict:
        """The frozen target's forward over a micro-batch, once; `drafter_outputs` then takes its
        anchors chunk by chunk. `taps` / `slots` (default: this drafter's) may be supersets, for
        several drafters at once (`target_view` takes each one's part)."""
        taps = self.taps if taps is None else tuple(taps)
        slots = self.slots if slots is None else slots
        A = max(1, max(len(a) for _, a in items))
        seqs = [(s.prompt_ids + s.response_ids)[: self.cfg.max_seq_len] for s, _ in items]
        b, S = len(seqs), max(len(x) for x in seqs)
        ids = torch.zeros(b, S, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)
        lengths = torch.tensor([len(x) for x in seqs])
        anchors = torch.zeros(b, A, dtype=torch.long)
        valid = torch.zeros(b, A, dtype=torch.bool)
        for i, (_, a) in enumerate(items):
            anchors[i, : len(a)] = torch.tensor(a, dtype=torch.long)
            valid[i, : len(a)] = True
        ids, lengths, anchors, valid = (t.to(self.device) for t in (ids, lengths, anchors, valid))
        tm = self.target.model
        t0 = self._clock()
        out = tm(ids, tm.new_cache(b, S), taps=taps)
        # the target's distribution once per input position a slot reads (anchors' blocks overlap:
        # with every anchor, each position is read by up to γ slots)
        pos = anchors[..., None] + torch.arange(slots, device=self.device)  # each slot's input; predicts pos + 1
        sup = valid[..., None] & (pos + 1 < lengths[:, None, None])
        at = pos.clamp(max=S - 1)
        labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1).gather(1, at.flatten(1)).view_as(at)
        flat = torch.arange(b, device=self.device)[:, None, None] * S + at  # index into the [b * S] positions
        needed = torch.unique(flat[sup])
        row_of = torch.full((b * S,), -1, dtype=torch.long, device=self.device)
        row_of[needed] = torch.arange(needed.numel(), device=self.device)
        hidden = out.hidden.reshape(b * S, -1)
        ids_k = self._draft_ids
        with torch.no_grad():  # plain (non-inference) tensors, in rows of bounded size
            parts = [TargetDist.from_logits(tm.logits(hidden[needed[i : i + 1024]]).clone(), ids_k)
                     for i in range(0, needed.numel(), 1024)]
        if parts:
            dist = TargetDist.cat(parts)
        else:  # no supervised slot in this micro-batch
            k = self.target.cfg.vocab_size if ids_k is None else ids_k.numel()
            dist = TargetDist(torch.zeros(0, k, device=self.device), torch.zeros(0, device=self.device),
                              torch.zeros(0, dtype=torch.long, device=self.device))
        target_s = self._clock() - t0
        return dict(ids=ids, anchors=anchors, sup=sup, labels=labels, rows=row_of[flat], taps=out.taps, tap_ids=taps,
                    dist=dist, tokens=int(lengths.sum()), blocks=int(valid.sum()), target_s=target_s)

    def target_view(self, t: dict) -> dict:
        """This drafter's part of `target_outputs` computed with more taps or slots."""
        if t["tap_ids"] == self.taps and t["sup"].shape[-1] == self.slots:
            return t
        cut = {k: t[k][..., : self.slots] for k in ("sup", "labels", "rows")}
        return {**t, **cut, "taps": t["taps"][:, :, [t["tap_ids"].index(x) for x in self.taps]], "tap_ids": self.taps}

    def anchor_spans(self, t: dict) -> list[tuple[int, int]]:
        A, k = t["anchors"].shape[1], self.cfg.anchor_chunk
        return [(a, min(a + k, A)) for a in range(0, A, k)]

    def drafter_outputs(self, t: dict, model, span: tuple[int, int]) -> dict:
        """Drafter forward for anchors [span) of every sequence, and the target's distributions at
        their supervised slots: what the losses need."""
        part = slice(*span)
        sup = t["sup"][:, part]
        tm = self.target.model
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with amp:
            logits, conf = model(t["taps"], t["ids"], t["anchors"][:, part], tm.embed_tokens, tm.lm_head)
        w = (self.weights_k * sup).float()
        return dict(logits=logits, conf=conf, target=t["dist"][t["rows"][:, part][sup]], labels=t["labels"][:, part],
                    sup=sup, w=w)

    def _loss_sums(self, o):
        c = self.cfg
        sup = o["sup"]
        conf = o["conf"][sup] if o["conf"] is not None else None
        ids = self._draft_ids
        if c.algorithm == "dflash":
            return kd_loss_sums(o["logits"][sup], None, o["target"], o["labels"][sup], o["w"][sup], 1.0, 0.0, 0.0,
                                draft_ids=ids)
        if c.algorithm == "eagle3":
            return kd_loss_sums(o["logits"][sup], None, o["target"], o["labels"][sup], o["w"][sup], 0.0, 0.0,
                                0.0, soft_ce_weight=1.0, draft_ids=ids)
        return kd_loss_sums(o["logits"][sup], conf, o["target"], o["labels"][sup], o["w"][sup],
                            c.ce_weight, c.tv_weight, c.conf_weight, draft_ids=ids)

    @property
    def _draft_ids(self) -> torch.Tensor | None:
        """The drafter's vocabulary (target ids, on the device), None for the full one."""
        ids = self.model.draft_ids
        return None if ids is None else ids.to(self.device)

    def _clock(self) -> float:
        """Wall time, after the device has finished the work queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ---- training ------------------------------------------------------------------------
    def micro_batches(self, items) -> list:
        """This rank's share of a step's (sample, anchors), in `grad_accum` micro-batches."""
        mine = items[self.rank :: self.world]
        micro = max(1, math.ceil(len(mine) / self.cfg.grad_accum))
        return [mine[i : i + micro] for i in range(0, len(mine), micro)]

    def train_step(self, targets: list[dict] | None = None) -> dict:
        """One optimiser step. `targets`: the target's outputs for this step's micro-batches, already
        computed (shared by several drafters); their time is then reported, not spent here."""
        c = self.cfg
        t0 = time.perf_counter()
        items = self.global_batch(self.step)
        total_w = self._slot_weights(items)
        chunks = self.micro_batches(items)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, c)
        sums = torch.zeros(4, dtype=torch.float64)
        tokens = blocks = slots = 0
        target_s = 0.0
        t_batches = self._clock()
        for i, chunk in enumerate(chunks):
            t = self.target_outputs(chunk) if targets is None else self.target_view(targets[i])
            spans = self.anchor_spans(t)
            tokens += t["tokens"]
            blocks += t["blocks"]
            target_s += t["target_s"]
            for j, span in enumerate(spans):
                last = i == len(chunks) - 1 and j == len(spans) - 1  # DDP all-reduces on the last backward only
                sync = contextlib.nullcontext() if last or self.world == 1 else self.ddp.no_sync()
                with sync:
                    o = self.drafter_outputs(t, self.ddp, span)
                    ls = self._loss_sums(o)
                    if total_w > 0:
                        (ls.total * (self.world / total_w)).backward()
                sums += torch.tensor([ls.total.item(), ls.ce.item(), ls.tv.item(), ls.conf.item()], dtype=torch.float64)
                slots += int(o["sup"].sum())
        t_optimizer = self._clock()
        counts = torch.tensor([tokens, blocks, slots], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(counts)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        t_end = self._clock()
        dt = t_end - t0 + (target_s if targets is not None else 0.0)
        m = (sums / max(total_w, 1e-12)).tolist()
        return {"step": self.step, "lr": lr_at(self.step - 1, c), "loss": m[0], "ce": m[1], "tv": m[2],
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
        bs = max(1, self.cfg.batch_size // self.world)
        for i in range(0, len(self.val_set), bs):
            items = [(s, sample_anchors(s, self.cfg.max_seq_len, self.cfg.anchors_per_seq,
                                        derived_generator(self.cfg.seed, "val", i + j)))
                     for j, s in enumerate(self.val_set[i : i + bs])]
            t = self.target_outputs(items)
            for span in self.anchor_spans(t):
                o = self.drafter_outputs(t, self.model, span)
                ls = self._loss_sums(o)
                sums += torch.tensor([ls.total.item(), ls.ce.item(), ls.tv.item(), ls.conf.item()], dtype=torch.float64)
                total_w += float(o["w"].sum())
                sup = o["sup"]
                block_pos = torch.arange(g, device=self.device).expand_as(sup)[sup]
                s_, c_ = acceptance_sums(o["logits"][sup], o["target"], block_pos, g, self._draft_ids)
                a_sum += s_.cpu()
                a_cnt += c_.cpu()
                greedy += greedy_acceptance_sums(o["logits"][sup], o["target"], block_pos, g, self._draft_ids).cpu()
        self.model.train()
        alpha = (a_sum / a_cnt.clamp(min=1)).tolist()
        alpha_greedy = (greedy / a_cnt.clamp(min=1)).tolist()
        m = (sums / max(total_w, 1e-12)).tolist()
        return {"loss": m[0], "ce": m[1], "tv": m[2], "conf": m[3], "alpha": alpha, "expected_tau": expected_tau(alpha),
                "alpha_greedy": alpha_greedy, "expected_tau_greedy": expected_tau(alpha_greedy)}

    # ---- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        if self.rank == 0:
            dtype = CHECKPOINT_DTYPES[self.cfg.checkpoint_dtype]
            with atomic_directory(self.out / "checkpoint") as tmp:
                save_drafter(self.model, tmp / "drafter", target=self.target, dtype=dtype)
                tensors = {}
                for i, p in enumerate(self.model.parameters()):
                    for k, v in self.optimizer.state.get(p, {}).items():
                        v = torch.as_tensor(v).detach().cpu()
                        # moments in the checkpoint's dtype; AdamW's 0-dim step counter stays as it is
                        tensors[f"{i}.{k}"] = v.to(dtype) if v.dim() else v.clone()
                save_file(tensors, tmp / "optimizer.safetensors")
                state = {"step": self.step, "config": self.cfg.to_dict(), "world_size": self.world,
                         "data_fingerprint": self.data_fingerprint()}
                (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        if self.world > 1:
            dist.barrier()

    def _load_checkpoint(self, ckpt: Path) -> None:
        try:
            state = json.loads((ckpt / "state.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DsparkError(f"{ckpt} is not a readable training checkpoint: {e}") from None
        saved = {**ADDED_OPTIONS, **state["config"]}
        ignored = RESUMABLE_CHANGES | ({"draft_layer", "confidence_head_with_markov"}
                                       if self.cfg.algorithm == "eagle3" else set())
        diff = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in self.cfg.to_dict().items()
                if k not in ignored and saved.get(k) != v]
        if diff:
            raise DsparkError(f"cannot resume {ckpt}: the configuration changed ({'; '.join(diff)}); set the "
                              "options back (e.g. --set draft_layer=target for a run begun before dspark used "
                              "DeepSpec's draft layer) or start a new run")
        if state.get("data_fingerprint") not in (None, self.data_fingerprint()):
            raise DsparkError(f"cannot resume {ckpt}: {self.cfg.data} changed since the checkpoint (different "
                              "samples would be drawn); restore the file or start a new run")
        model, _ = load_model(ckpt / "drafter", self.target)
        self.model.load_state_dict(model.state_dict())
        tensors = load_file(ckpt / "optimizer.safetensors")
        params = list(self.model.parameters())
        for i, p in enumerate(params):
            # moments go to the parameter's device and dtype; AdamW keeps its 0-dim step counter on the CPU
            entry = {k.split(".", 1)[1]: v.to(p.device, p.dtype) if v.dim() else v
                     for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
            if entry:
                self.optimizer.state[p] = entry
        self.step = int(state["step"])

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


def training_device(name: str) -> torch.device:
    """`auto`: this rank's CUDA GPU when one is visible (LOCAL_RANK under torchrun), else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records of steps after the checkpoint being resumed (that work was lost)."""
    if not path.exists():
        return
    records, _ = read_records(path)
    keep = [r for r in records if isinstance(r, dict) and r.get("step", step + 1) <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
