"""`dspark bench serve`: closed-loop load benchmark of every verification policy.

At concurrency C the engine has C slots and a queue of requests: whenever one finishes the next
joins, so C requests are always in flight. Every policy runs the same requests at every level,
in the same process (policies interleaved per level so machine drift hits all alike).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from dspark.decode.engine import Engine, Request
from dspark.decode.speculation import drafter_digest, engine_factory, resolve_drafter_spec
from dspark.model.loading import dtype_key
from dspark.model.target import Target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import parse_policy
from dspark.util.journal import Journal, json_digest
from dspark.util.plotting import pyplot


def bench_serve(target: Target, drafter_spec, policies: list[str], levels: list[int], prompts: list[str], requests_per_level: int,
                max_new_tokens: int, sps, temperature: float = 0.0, progress: bool = True,
                journal_path: Path | None = None) -> dict:
    """Every (concurrency, policy) cell. A level's requests run in up to four closed-loop chunks
    (each at least 2 x concurrency requests); policies take turns chunk by chunk in rotated order,
    so that machine drift hits all alike. With `journal_path`, finished chunks are kept there and a
    rerun with the same settings measures only the missing ones."""
    drafter_spec = resolve_drafter_spec(drafter_spec, target, auto="")  # the policies are given apart
    encoded = [target.encode_prompt(p) for p in prompts]
    make, label, _ = engine_factory(target, drafter_spec, max(map(len, encoded)) + max_new_tokens + 1)
    settings = {"target": str(target.path), "dtype": dtype_key(target.model), "drafter": drafter_digest(str(drafter_spec)),
                "requests": requests_per_level, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "prompts": json_digest(encoded), "chunking": "rotated chunks of max(2C, n/4)",
                "sps": list(sps.values) if sps else None}
    journal = Journal(journal_path, settings) if journal_path else None
    plan = {c: _chunks(max(requests_per_level, c), c) for c in levels}
    bar = tqdm(total=sum(len(v) for v in plan.values()) * len(policies), desc="bench serve", unit="run",
               disable=not progress)
    rows = []
    for c in levels:
        parts: dict[str, list[dict]] = {spec: [] for spec in policies}
        for k, ids in enumerate(plan[c]):
            for spec in policies[k % len(policies):] + policies[: k % len(policies)]:
                key = (c, spec, k)
                if journal and key in journal.done:
                    part = journal.done[key]
                else:
                    part = _run_chunk(make(parse_policy(spec, sps), c), encoded, ids, max_new_tokens, temperature)
                    if journal:
                        journal.add(key, part)
                parts[spec].append(part)
                bar.update(1)
        for spec in policies:
            rows.append(_cell_row(spec, c, parts[spec]))
    bar.close()
    return {"drafter": label, "policies": policies, "concurrency": levels, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "rows": rows, "sps": list(sps.values) if sps else None}


def _chunks(n: int, concurrency: int) -> list[range]:
    size = max(2 * concurrency, -(-n // 4))
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def _run_chunk(engine: Engine, encoded, ids: range, max_new_tokens: int, temperature: float) -> dict:
    reqs = [Request(encoded[i % len(encoded)], max_new_tokens, SamplingParams(temperature), seed=i) for i in ids]
    t0 = time.perf_counter()
    engine.run(reqs)
    wall = time.perf_counter() - t0
    rounds = [x for r in reqs for x in r.rounds]
    return {
        "requests": len(reqs), "output_tokens": sum(len(r.token_ids) for r in reqs), "seconds": wall,
        "per_user_tok_s": [(len(r.token_ids) - 1) / (r.finished_at - r.first_token_at)
                           for r in reqs if len(r.token_ids) > 1 and r.finished_at > r.first_token_at],
        "rounds": len(rounds), "drafted": sum(x.computed for x in rounds),  # a tree round: its nodes
        "committed": sum(x.accepted + 1 for x in rounds), "engine_steps": engine.steps,
    }


def _cell_row(policy: str, concurrency: int, parts: list[dict]) -> dict:
    total = lambda key: sum(p[key] for p in parts)  # noqa: E731
    per_user = [x for p in parts for x in p["per_user_tok_s"]]
    rounds = total("rounds")
    return {
        "policy": policy, "concurrency": concurrency, "requests": total("requests"),
        "output_tokens": total("output_tokens"), "seconds": total("seconds"),
        "throughput_tok_s": total("output_tokens") / total("seconds"),
        "per_user_tok_s": statistics.median(per_user) if per_user else 0.0,
        "avg_verify_len": total("drafted") / rounds if rounds else 0.0,
        "tau": total("committed") / rounds if rounds else 0.0,
        "engine_steps": total("engine_steps"), "chunks": len(parts),
    }


def per_user_at(rows: list[dict], policy: str, throughput: float) -> float | None:
    """`policy`'s per-user tok/s at an aggregate `throughput`, interpolated linearly between its two
    neighbouring measured concurrencies (None outside the range it reached)."""
    pts = sorted((r["throughput_tok_s"], r["per_user_tok_s"]) for r in rows if r["policy"] == policy)
    for (t0, u0), (t1, u1) in zip(pts, pts[1:]):
        if t0 <= throughput <= t1:
            return u0 if t1 == t0 else u0 + (u1 - u0) * (throughput - t0) / (t1 - t0)
    return pts[0][1] if len(pts) == 1 and pts[0][0] == throughput else None


def _comparison_lines(rows: list[dict], policies: list[str]) -> list[str]:
    """The issue's two checks, when `dspark` ran: its throughput against the best other policy and
    `ar` at each concurrency, and its per-user speed against `fixed:1` at matched throughput."""
    if "dspark" not in policies or len(policies) < 2:
        return []
    cell = {(r["concurrency"], r["policy"]): r for r in rows}
    out = ["", "## dspark against the other policies", "",
           "| concurrency | dspark tok/s | best other | dspark / best other | dspark / ar |", "|---|---|---|---|---|"]
    for c in sorted({r["concurrency"] for r in rows}):
        mine = cell[(c, "dspark")]["throughput_tok_s"]
        best = max((cell[(c, p)] for p in policies if p != "dspark"), key=lambda r: r["throughput_tok_s"])
        ar = f"{mine / cell[(c, 'ar')]['throughput_tok_s']:.2f}" if (c, "ar") in cell else "—"
        out.append(f"| {c} | {mine:.1f} | {best['policy']} {best['throughput_tok_s']:.1f} | "
                   f"{mine / best['throughput_tok_s']:.2f} | {ar} |")
    if "fixed:1" in policies:
        out += ["", "Per-user speed at matched throughput: at each `fixed:1` point, dspark's per-user tok/s at the "
                "same aggregate tok/s, interpolated along its own curve (— where its curve does not reach).", "",
                "| fixed:1 concurrency | aggregate tok/s | fixed:1 per-user | dspark per-user | ratio |",
                "|---|---|---|---|---|"]
        for r in sorted((r for r in rows if r["policy"] == "fixed:1"), key=lambda r: r["concurrency"]):
            u = per_user_at(rows, "dspark", r["throughput_tok_s"])
            mine, ratio = ("—", "—") if u is None else (f"{u:.1f}", f"{u / r['per_user_tok_s']:.2f}")
            out.append(f"| {r['concurrency']} | {r['throughput_tok_s']:.1f} | {r['per_user_tok_s']:.1f} | {mine} | {ratio} |")
    return out


def write_bench_report(result: dict, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result = dict(result, command=command)
    (out / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# dspark bench serve", "", f"`{command}` — drafter {result['drafter']}, {result['max_new_tokens']} new "
             f"tokens, T = {result['temperature']}. Closed loop: C requests always in flight.", "",
             "| concurrency | policy | output tok/s | per-user tok/s (median) | avg verify len | τ | steps |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['concurrency']} | {r['policy']} | {r['throughput_tok_s']:.1f} | {r['per_user_tok_s']:.1f} | "
                     f"{r['avg_verify_len']:.2f} | {r['tau']:.2f} | {r['engine_steps']} |")
    lines += _comparison_lines(result["rows"], result["policies"])
    (out / "serve.md").write_text("\n".join(lines) + "\n")

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 5))
    for policy in result["policies"]:
        pts = sorted((r for r in result["rows"] if r["policy"] == policy), key=lambda r: r["concurrency"])
        ax.plot([r["per_user_tok_s"] for r in pts], [r["throughput_tok_s"] for r in pts], "o-", label=policy)
        for r in pts:
            ax.annotate(str(r["concurrency"]), (r["per_user_tok_s"], r["throughput_tok_s"]), fontsize=7)
    ax.set(xlabel="per-user tokens/s (median)", ylabel="aggregate output tokens/s",
           title=f"throughput vs per-user speed, drafter {Path(str(result['drafter'])).name}\n"
                 "(point labels: concurrency)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=110)
    plt.close(fig)
