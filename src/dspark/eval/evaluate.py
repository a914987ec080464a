"""`dspark eval`: every drafter and plain AR on the same prompts, interleaved, with τ, acceptance,
calibration and wall-clock speed (DESIGN.md §5)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.decode.generate import Decoder
from dspark.decode.speculation import (
    AUTO,
    drafter_digest,
    load_speculation,
    resolve_drafter_spec,
    split_spec,
)
from dspark.decode.step import Round, drafts_per_round
from dspark.draft import vocab
from dspark.draft.hybrid import SUFFIX
from dspark.errors import DsparkError
from dspark.eval import metrics
from dspark.eval.prompts import load_eval_prompts
from dspark.model.loading import dtype_key
from dspark.model.target import Target
from dspark.sampling import SamplingParams
from dspark.util.journal import Journal, json_digest
from dspark.util.platform import cpu_flags


@dataclasses.dataclass
class RunAccumulator:
    rounds: list[Round] = dataclasses.field(default_factory=list)
    tokens: int = 0  # decode-round tokens (prefill token excluded)
    decode_s: float = 0.0
    prompts: int = 0
    replies: list[list[int]] = dataclasses.field(default_factory=list)  # AR's token ids (the target's replies)

    def add(self, record: dict) -> None:
        self.rounds += [Round(*r) for r in record["rounds"]]
        self.tokens += record["decode_tokens"]
        self.decode_s += record["decode_s"]
        self.prompts += 1
        if "token_ids" in record:
            self.replies.append(record["token_ids"])

    @property
    def tok_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


def generation_record(result, keep_tokens: bool = False) -> dict:
    """What the report needs of one generation, as JSON (the journal's line); AR's keeps its tokens,
    against which draft vocabularies are measured."""
    record = {"decode_tokens": result.stats.new_tokens - 1, "decode_s": result.stats.decode_s,
              "rounds": [[r.verified, r.accepted, r.confidence_logits, r.nodes] for r in result.rounds],
              "cpu_flags": " ".join(cpu_flags())}  # a run resumed in another session may be on another CPU
    if keep_tokens:
        record["token_ids"] = result.token_ids
    return record


def drafter_name(spec: str) -> str:
    """Short display name: the checkpoint directory's name (its run's name for `.../final`), with
    the verification rule when it is not `full`."""
    base, rule = split_spec(spec)
    plain = base.removesuffix(SUFFIX)
    path = Path(plain)
    if not path.exists():
        return spec
    path = path.resolve()
    name = (path.parent.name if path.name in ("final", "checkpoint", "drafter") else path.name) + base[len(plain):]
    return name if rule == "full" else f"{name}@{rule}"


def evaluate(
    target: Target,
    drafter_specs: list[str],
    datasets: list[Path],
    limit: int | None,
    max_new_tokens: int,
    temperatures: list[float],
    seed: int = 0,
    confidence_threshold: float | None = None,
    progress: bool = True,
    journal_path: Path | None = None,
    peers: list | None = None,
) -> dict:
    """Run every drafter and AR on the same prompts; returns {"runs": [...], "peers": [...]} (see README).

    `peers`: other engines' plain decoders (`LlamaCppDecoder`), run in the same rotation; their rows
    report decode speed only. With `journal_path`, finished generations are kept there and a rerun
    with the same settings continues where the last one stopped."""
    prompt_sets = {Path(d).stem: load_eval_prompts(d)[:limit] for d in datasets}
    drafter_specs = [resolve_drafter_spec(s, target, AUTO) for s in drafter_specs]
    engines, drafters = _engines(target, drafter_specs, confidence_threshold, peers or [])
    settings = {"target": str(target.path), "dtype": dtype_key(target.model), "max_new_tokens": max_new_tokens,
                "temperatures": temperatures, "seed": seed, "confidence_threshold": confidence_threshold,
                "datasets": {ds: json_digest(p) for ds, p in prompt_sets.items()},
                "drafters": {spec: drafter_digest(spec) for spec in drafter_specs}}
    if peers:
        settings["peers"] = {p.name: str(p.path) for p in peers}
    journal = Journal(journal_path, settings) if journal_path else None
    acc, measured_on = _generate_all(target, engines, prompt_sets, temperatures, max_new_tokens, seed, journal,
                                     progress)
    runs, peer_rows = [], []
    for temp in temperatures:
        for name, drafter in drafters.items():
            per_ds = [_run_record(name, ds, temp, acc[(name, ds, temp)], acc[("ar", ds, temp)], drafter)
                      for ds in prompt_sets]
            runs += per_ds + [_macro(name, temp, per_ds)]
        for peer in peers or []:
            per_ds = [_peer_record(peer.name, ds, temp, acc[(peer.name, ds, temp)], acc[("ar", ds, temp)])
                      for ds in prompt_sets]
            peer_rows += per_ds + [_peer_macro(peer.name, temp, per_ds)]
    return {"runs": runs, "peers": peer_rows, "config": {"datasets": {k: len(v) for k, v in prompt_sets.items()},
                                     "max_new_tokens": max_new_tokens, "temperatures": temperatures, "seed": seed,
                                     "confidence_threshold": confidence_threshold, "drafters": drafter_specs,
                                     "machine": {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
                                                 "dtype": dtype_key(target.model),
                                                 "generations_by_cpu_flags": dict(measured_on)}}}


def _engines(target: Target, drafter_specs: list[str], confidence_threshold: float | None, peers: list):
    """({name: decoder}: AR first, then each drafter's and each peer's, {name: drafter})."""
    engines: dict[str, Decoder] = {"ar": Decoder(target)}
    drafters = {}
    for spec in drafter_specs:
        name = drafter_name(spec)
        if name in engines:
            raise DsparkError(f"drafter {spec!r} given twice")
        threshold = confidence_threshold if spec not in ("prompt-lookup", "none") else None
        _, drafters[name], policy = load_speculation(spec, target, None, threshold)
        engines[name] = Decoder(target, drafters[name], policy)
    for peer in peers:
        if peer.name in engines:
            raise DsparkError(f"{peer.name} given twice")
        engines[peer.name] = peer
    return engines, drafters


def _generate_all(target: Target, engines: dict, prompt_sets: dict[str, list[str]], temperatures: list[float],
                  max_new_tokens: int, seed: int, journal: Journal | None, progress: bool):
    """Every engine on every prompt at every temperature, engines rotating per prompt (drift hits all
    alike); ({(engine, dataset, T): RunAccumulator}, generations by the CPU flags that ran them)."""
    done = dict(journal.done) if journal else {}
    total = len(temperatures) * sum(len(p) for p in prompt_sets.values()) * len(engines)
    acc: dict[tuple[str, str, float], RunAccumulator] = {}
    measured_on: Counter = Counter()
    bar = tqdm(total=total, desc="evaluating", unit="gen", disable=not progress)
    names = list(engines)
    for temp in temperatures:
        params = SamplingParams(temperature=temp)
        for ds, prompts in prompt_sets.items():
            for i, text in enumerate(prompts):
                ids = None
                order = names[i % len(names) :] + names[: i % len(names)]
                group = [(temp, ds, i, name) for name in order]
                # a prompt's engines run back to back on one machine: one cut short by a kill is redone whole
                if not all(key in done for key in group):
                    for key in group:
                        done.pop(key, None)
                for name, key in zip(order, group):
                    record = done.get(key)
                    if record is None:
                        ids = ids or target.encode_prompt(text)
                        result = engines[name].generate(ids, max_new_tokens, params, seed=seed + i)
                        record = generation_record(result, keep_tokens=name == "ar")
                        if journal:
                            journal.add(key, record)
                    acc.setdefault((name, ds, temp), RunAccumulator()).add(record)
                    measured_on[record.get("cpu_flags", "unrecorded")] += 1
                    bar.update(1)
    bar.close()
    return acc, measured_on


def _run_record(name, ds, temp, a: RunAccumulator, ar: RunAccumulator, drafter) -> dict:
    positions, temps = drafter.max_drafts, drafter.temperatures
    calibration = metrics.calibration_report(a.rounds, positions, temps)
    if calibration is not None:
        raw = metrics.calibration_report(a.rounds, positions, None)
        calibration["temperatures"] = temps
        calibration["uncalibrated"] = {k: raw[k] for k in ("ece", "auc", "brier", "per_position")}
        calibration["threshold_sweep"] = metrics.threshold_sweep(
            a.rounds, [i / 20 for i in range(20)], temps)
    model = getattr(drafter, "model", None)  # None: prompt lookup, which has no vocabulary
    return {
        "drafter": name,
        "dataset": ds,
        "temperature": temp,
        "prompts": a.prompts,
        # share of the target's own reply tokens (AR's, this set) that the draft vocabulary holds
        "vocab_coverage": vocab.coverage(ar.replies, model.draft_ids) if model is not None and ar.replies else None,
        "tau": metrics.tau(a.rounds),
        "cond_accept": metrics.conditional_acceptance(a.rounds, positions),
        "verify_efficiency": metrics.verify_efficiency(a.rounds),
        "drafts_per_round": drafts_per_round(a.rounds),
        "decode_tok_s": a.tok_s,
        "ar_decode_tok_s": ar.tok_s,
        "speedup": a.tok_s / ar.tok_s if ar.tok_s else 0.0,
        # seconds a round (draft + verify) in AR decode steps: speedup = tokens per round / round cost
        "round_cost": (a.decode_s / len(a.rounds)) / (ar.decode_s / ar.tokens) if a.rounds and ar.tokens else 0.0,
        "calibration": calibration,
    }


def _peer_record(name, ds, temp, a: RunAccumulator, ar: RunAccumulator) -> dict:
    return {"engine": name, "dataset": ds, "temperature": temp, "prompts": a.prompts, "decode_tok_s": a.tok_s,
            "ar_decode_tok_s": ar.tok_s, "speedup": a.tok_s / ar.tok_s if ar.tok_s else 0.0}


def _column_mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def _peer_macro(name, temp, rows: list[dict]) -> dict:
    mean = functools.partial(_column_mean, rows)
    return {"engine": name, "dataset": "macro", "temperature": temp, "prompts": sum(r["prompts"] for r in rows),
            "decode_tok_s": mean("decode_tok_s"), "ar_decode_tok_s": mean("ar_decode_tok_s"), "speedup": mean("speedup")}


def _macro(name, temp, rows: list[dict]) -> dict:
    mean = functools.partial(_column_mean, rows)
    positions = max(len(r["cond_accept"]) for r in rows)
    cond = []
    for k in range(positions):
        vals = [r["cond_accept"][k] for r in rows if k < len(r["cond_accept"]) and r["cond_accept"][k] is not None]
        cond.append(statistics.fmean(vals) if vals else None)
    cals = [r["calibration"] for r in rows if r["calibration"]]
    calibration = None
    if cals:
        calibration = {k: statistics.fmean(c[k] for c in cals) for k in ("ece", "auc", "brier")}
        calibration["uncalibrated"] = {k: statistics.fmean(c["uncalibrated"][k] for c in cals)
                                       for k in ("ece", "auc", "brier")}
    coverage = [r["vocab_coverage"] for r in rows if r["vocab_coverage"] is not None]
    return {"drafter": name, "dataset": "macro", "temperature": temp, "prompts": sum(r["prompts"] for r in rows),
            "vocab_coverage": statistics.fmean(coverage) if coverage else None, "tau": mean("tau"), "cond_accept": cond,
            "verify_efficiency": mean("verify_efficiency"), "drafts_per_round": mean("drafts_per_round"),
            "decode_tok_s": mean("decode_tok_s"), "ar_decode_tok_s": mean("ar_decode_tok_s"),
            "speedup": mean("speedup"), "round_cost": mean("round_cost"), "calibration": calibration}


