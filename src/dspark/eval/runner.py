"""`dspark eval`: every drafter and plain AR on the same prompts, interleaved, with τ, acceptance,
calibration and wall-clock speed (DESIGN.md §5)."""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.decode.generate import Decoder
from dspark.decode.sampling import SamplingParams
from dspark.decode.step import Round
from dspark.draft import vocab
from dspark.draft.registry import drafter_digest, resolve_drafter_spec, split_spec
from dspark.errors import DsparkError
from dspark.eval import metrics
from dspark.schedule.rules import load_speculation
from dspark.target.loading import dtype_key
from dspark.train.data import read_jsonl
from dspark.util.journal import Journal, json_digest
from dspark.util.platform import cpu_flags

DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[3] / "data" / "eval"


def load_eval_prompts(path: str | Path) -> list[str]:
    """First user turn of every line ({"turns": [...]}); a malformed line stops with its number."""
    prompts = []
    for lineno, obj in read_jsonl(path):
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DsparkError(f"{path}:{lineno}: expected {{\"turns\": [\"user message\", ...]}}")
        prompts.append(turns[0])
    if not prompts:
        raise DsparkError(f"{path} holds no prompts")
    return prompts


def default_datasets() -> list[Path]:
    files = sorted(DEFAULT_EVAL_DIR.glob("*.jsonl"))
    if not files:
        raise DsparkError("no --dataset given and the bundled evaluation sets were not found; pass --dataset FILE")
    return files


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
              "rounds": [[r.verified, r.accepted, r.confidence_logits] for r in result.rounds],
              "cpu_flags": " ".join(cpu_flags())}  # a run resumed in another session may be on another CPU
    if keep_tokens:
        record["token_ids"] = result.token_ids
    return record


def drafter_name(spec: str) -> str:
    """Short display name: the checkpoint directory's name (its run's name for `.../final`), with
    the verification rule when it is not `full`."""
    base, rule = split_spec(spec)
    path = Path(base)
    if not path.exists():
        return spec
    path = path.resolve()
    name = path.parent.name if path.name in ("final", "checkpoint", "drafter") else path.name
    return name if rule == "full" else f"{name}@{rule}"


def evaluate(
    target,
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
    engines: dict[str, Decoder] = {"ar": Decoder(target)}
    drafters = {}
    drafter_specs = [resolve_drafter_spec(s, target) for s in drafter_specs]
    for spec in drafter_specs:
        name = drafter_name(spec)
        if name in engines:
            raise DsparkError(f"drafter {spec!r} given twice")
        threshold = confidence_threshold if spec not in ("prompt-lookup", "none") else None
        _, drafters[name], policy = load_speculation(spec, target, None, threshold)
        engines[name] = Decoder(target, drafters[name], policy)
    for peer in peers or []:
        if peer.name in engines:
            raise DsparkError(f"{peer.name} given twice")
        engines[peer.name] = peer
    settings = {"target": str(target.path), "dtype": dtype_key(target.model), "max_new_tokens": max_new_tokens,
                "temperatures": temperatures, "seed": seed, "confidence_threshold": confidence_threshold,
                "datasets": {ds: json_digest(p) for ds, p in prompt_sets.items()},
                "drafters": {spec: drafter_digest(spec) for spec in drafter_specs}}
    if peers:
        settings["peers"] = {p.name: str(p.path) for p in peers}
    journal = Journal(journal_path, settings) if journal_path else None
    done = dict(journal.done) if journal else {}
    total = len(temperatures) * sum(len(p) for p in prompt_sets.values()) * len(engines)
    acc: dict[tuple[str, str, float], RunAccumulator] = {}
    measured_on: Counter = Counter()  # generations by the CPU flags of the machine that ran them
    bar = tqdm(total=total, desc="evaluating", unit="gen", disable=not progress)
    names = list(engines)
    for temp in temperatures:
        params = SamplingParams(temperature=temp)
        for ds, prompts in prompt_sets.items():
            for i, text in enumerate(prompts):
                ids = None
                order = names[i % len(names) :] + names[: i % len(names)]  # rotate: drift hits all alike
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

    runs = []
    for temp in temperatures:
        for name, drafter in drafters.items():
            per_ds = []
            for ds in prompt_sets:
                a, ar = acc[(name, ds, temp)], acc[("ar", ds, temp)]
                per_ds.append(_run_record(name, ds, temp, a, ar, drafter))
            runs += per_ds
            runs.append(_macro(name, temp, per_ds))
    peer_rows = []
    for temp in temperatures:
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
            "vocab_coverage": statistics.fmean(coverage) if coverage else None, "tau": mean("tau"), "cond_accept": cond, "verify_efficiency": mean("verify_efficiency"),
            "decode_tok_s": mean("decode_tok_s"), "ar_decode_tok_s": mean("ar_decode_tok_s"),
            "speedup": mean("speedup"), "round_cost": mean("round_cost"), "calibration": calibration}


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    cfg = results["config"]
    lines = ["# dspark eval", "",
             f"Datasets {cfg['datasets']} (prompts each), {cfg['max_new_tokens']} new tokens, seed {cfg['seed']}, "
             f"confidence threshold {cfg['confidence_threshold']}. Every drafter and plain AR ran the same prompts "
             "in rotating order; speedup = decode tok/s over AR's on the same prompts in the same run; round cost = "
             "seconds per draft-and-verify round in AR decode steps (speedup = tokens per round / round cost).",
             _machine_line(cfg.get("machine")), ""]
    for temp in cfg["temperatures"]:
        lines += [f"## T = {temp}", "",
                  "| drafter | dataset | τ | verify eff. | decode tok/s | AR tok/s | speedup | round cost "
                  "| ECE raw → STS | AUC raw → STS | Brier raw → STS | vocab coverage |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["runs"]:
            if r["temperature"] != temp:
                continue
            cal = _calibration_cells(r["calibration"])
            name = f"**{r['dataset']}**" if r["dataset"] == "macro" else r["dataset"]
            coverage = "–" if r.get("vocab_coverage") is None else f"{r['vocab_coverage']:.1%}"
            lines.append(f"| {r['drafter']} | {name} | {r['tau']:.2f} | {r['verify_efficiency']:.2f} | "
                         f"{r['decode_tok_s']:.1f} | {r['ar_decode_tok_s']:.1f} | {r['speedup']:.2f}x | {r['round_cost']:.2f} | {cal} "
                         f"| {coverage} |")
        lines += ["", "Conditional acceptance by block position (macro average):", "",
                  "| drafter | " + " | ".join(f"k={k}" for k in range(_max_positions(results, temp))) + " |",
                  "|---|" + "---|" * _max_positions(results, temp)]
        for r in results["runs"]:
            if r["temperature"] == temp and r["dataset"] == "macro":
                lines.append(f"| {r['drafter']} | " + " | ".join("–" if v is None else f"{v:.2f}"
                                                               for v in r["cond_accept"]) + " |")
        lines.append("")
        lines += _peer_lines(results, temp)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    from dspark.eval.plots import plot_eval

    plot_eval(results, out)


def _machine_line(machine: dict | None) -> str:
    if not machine:
        return ""
    line = (f"Machine: {machine['threads']} threads, CPU flags {' '.join(machine['cpu_flags']) or 'none of note'}, "
            f"target dtype {machine['dtype']}.")
    by_flags = machine.get("generations_by_cpu_flags", {})
    if len(by_flags) > 1:  # resumed across machines: the speed figures mix them
        line += " Generations by the CPU flags of the machine that ran them: " + "; ".join(
            f"{flags or 'none of note'}: {n}" for flags, n in sorted(by_flags.items(), key=lambda kv: -kv[1])) + "."
    return line


def _peer_lines(results: dict, temp: float) -> list[str]:
    """Other engines' plain decoding on the same prompts, and each drafter's speed over theirs."""
    peers = [r for r in results.get("peers", []) if r["temperature"] == temp]
    if not peers:
        return []
    lines = ["Other engines, plain decoding (same prompts, same rotation):", "",
             "| engine | dataset | decode tok/s | dspark AR tok/s | over dspark AR |", "|---|---|---|---|---|"]
    for r in peers:
        name = f"**{r['dataset']}**" if r["dataset"] == "macro" else r["dataset"]
        lines.append(f"| {r['engine']} | {name} | {r['decode_tok_s']:.1f} | {r['ar_decode_tok_s']:.1f} "
                     f"| {r['speedup']:.2f}x |")
    rows = {(r["drafter"], r["dataset"]): r for r in results["runs"] if r["temperature"] == temp}
    drafters = [r["drafter"] for r in results["runs"] if r["temperature"] == temp and r["dataset"] == "macro"]
    engines = [r["engine"] for r in peers if r["dataset"] == "macro"]
    lines += ["", "Decode tok/s over the other engine's, mean over the datasets:", "",
              "| | " + " | ".join(f"over {e}" for e in engines) + " |", "|---|" + "---|" * len(engines),
              "| dspark AR | " + " | ".join(f"{_mean_ratio(peers, e, lambda r: r['ar_decode_tok_s']):.2f}x"
                                           for e in engines) + " |"]
    for d in drafters:
        speed = lambda r, d=d: rows[(d, r["dataset"])]["decode_tok_s"]  # noqa: E731
        lines.append(f"| {d} | " + " | ".join(f"{_mean_ratio(peers, e, speed):.2f}x" for e in engines) + " |")
    return lines + [""]


def _mean_ratio(peers: list[dict], engine: str, speed) -> float:
    per_ds = [speed(r) / r["decode_tok_s"] for r in peers if r["engine"] == engine and r["dataset"] != "macro"
              and r["decode_tok_s"]]
    return statistics.fmean(per_ds) if per_ds else 0.0


def _calibration_cells(calibration: dict | None) -> str:
    """'raw → STS' per metric: the confidence head before and after its fitted temperatures."""
    if not calibration:
        return "– | – | –"
    raw = calibration["uncalibrated"]
    return " | ".join(f"{raw[k]:.3f} → {calibration[k]:.3f}" for k in ("ece", "auc", "brier"))


def _max_positions(results, temp) -> int:
    return max((len(r["cond_accept"]) for r in results["runs"] if r["temperature"] == temp), default=0)
