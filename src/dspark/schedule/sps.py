"""SPS(B) profiling: target steps per second for a verification forward of B tokens.

Measured once per (model, dtype, threads, machine) and cached as JSON under the dspark cache
directory, so an engine start reloads it instead of profiling again.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.errors import DsparkError
from dspark.model.compiled import COMPILED_VERSION
from dspark.model.target import Target
from dspark.model.transformer import RUNNER_VERSION
from dspark.sampling import SamplingParams
from dspark.schedule.policies import SPSTable
from dspark.util.cache import cache_root
from dspark.util.files import atomic_write_text
from dspark.util.journal import json_digest
from dspark.util.plotting import pyplot


def _machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fit_context(target: Target, context: int, tokens: int) -> int:
    """The profiling context clipped so that `context + tokens` fits the target's window."""
    room = target.model.max_positions - tokens
    if room < 1:
        raise DsparkError(f"cannot profile {tokens}-token forwards: the target's window is only "
                          f"{target.model.max_positions} positions")
    return min(context, room)


def profile_key(target: Target, max_tokens: int, context: int) -> dict:
    device = target.model.device
    return {
        "model": str(target.path),
        "dtype": target.model.precision,
        "runner": RUNNER_VERSION,  # a faster runner makes older profiles wrong
        "compiled": COMPILED_VERSION if target.model.compiled is not None else False,  # a new graph, a new curve
        "threads": torch.get_num_threads(),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else _machine(),
        "max_tokens": max_tokens,
        "context": context,
    }


def cache_file(key: dict, prefix: str = "") -> Path:
    return cache_root() / "sps" / f"{prefix}{json_digest(key)}.json"


def profile_sizes(max_tokens: int) -> list[int]:
    """The forward sizes measured: every B up to 16 (where a round's drafts live), then every 4th to
    64, every 8th to 128 and every 16th beyond, and `max_tokens` (kernel blocking steps fall on
    multiples of 8 / 16); the sizes between are interpolated. ~4x fewer forwards than every B at 144."""
    sizes = [b for b in range(1, max_tokens + 1)
             if b <= 16 or (b <= 64 and b % 4 == 0) or (b <= 128 and b % 8 == 0) or b % 16 == 0]
    return sizes if sizes[-1] == max_tokens else [*sizes, max_tokens]


def interpolate_seconds(seconds: dict[int, float], max_tokens: int) -> list[float]:
    """Seconds per forward for B = 1..max_tokens, linear between the measured sizes."""
    known = sorted(seconds)
    out = []
    for b in range(1, max_tokens + 1):
        hi = next(k for k in known if k >= b)
        lo = max((k for k in known if k <= b), default=hi)
        w = 0.0 if hi == lo else (b - lo) / (hi - lo)
        out.append(seconds[lo] * (1 - w) + seconds[hi] * w)
    return out


def monotone_seconds(seconds: dict[int, float]) -> dict[int, float]:
    """The non-decreasing fit closest to measured seconds per forward (pool adjacent violators, least
    squares): more tokens never cost less, and a bump of machine noise in a raw profile would stop
    Algorithm 1's admission there (a 7-token forward timed 28 ms between 33 ms neighbours made the
    engine verify ~0.25 drafts per row at 8 rows)."""
    blocks: list[list[float]] = []  # [mean, count] of pooled runs, in order of B
    for b in sorted(seconds):
        blocks.append([seconds[b], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    fitted = [m for m, n in blocks for _ in range(int(n))]
    return dict(zip(sorted(seconds), fitted))


@torch.inference_mode()
def measure_sps(target: Target, max_tokens: int = 64, context: int = 256, reps: int = 5, progress: bool = True) -> SPSTable:
    """Median steps/s of a B-token forward (+ LM head over the B positions) after `context` tokens,
    for B = 1..max_tokens (`profile_sizes` measured, fitted non-increasing, the rest interpolated);
    sizes are visited round-robin so machine drift hits all alike."""
    if max_tokens < 1 or context < 1:
        raise DsparkError("SPS profiling needs max_tokens >= 1 and context >= 1")
    model = target.model
    if context + max_tokens > model.max_positions:
        raise DsparkError(f"context {context} + {max_tokens} tokens exceeds the model's {model.max_positions} positions")
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, context + max_tokens)
    model(torch.randint(0, model.cfg.vocab_size, (1, context), generator=gen), cache)
    times: dict[int, list[float]] = {b: [] for b in profile_sizes(max_tokens)}
    sweeps = tqdm(range(reps + 1), desc=f"profiling SPS(B) at {len(times)} sizes of 1..{max_tokens}",
                  disable=not progress, unit="sweep")
    for rep in sweeps:
        for b in times:
            x = torch.randint(0, model.cfg.vocab_size, (1, b), generator=gen)
            t0 = time.perf_counter()
            model.logits(model(x, cache).hidden[0])
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            cache.truncate(context)
            if rep:  # the first sweep warms up
                times[b].append(dt)
    medians = {b: statistics.median(t) for b, t in times.items()}
    seconds = interpolate_seconds(monotone_seconds(medians), max_tokens)
    return SPSTable(tuple(1.0 / t for t in seconds))


def load_or_measure(target: Target, max_tokens: int = 64, context: int = 256, reps: int = 5, force: bool = False,
                    progress: bool = True) -> tuple[SPSTable, Path, bool]:
    """The cached table for this setup, or a fresh measurement (then cached). Returns
    (table, cache path, whether it was measured now). The context is clipped to the target's window
    (the cache key records the context measured)."""
    context = fit_context(target, context, max_tokens)
    key = profile_key(target, max_tokens, context)
    path = cache_file(key)
    table = None if force else _cached_table(path, key)
    if table is not None:
        return table, path, False
    table = measure_sps(target, max_tokens, context, reps, progress)
    _write_cache(path, {"key": key, "sps": list(table.values)})
    return table, path, True


def cached_sps(target: Target, max_tokens: int = 64, context: int = 256) -> SPSTable | None:
    """The cached table `load_or_measure` would return, or None when it would have to measure."""
    context = fit_context(target, context, max_tokens)
    key = profile_key(target, max_tokens, context)
    return _cached_table(cache_file(key), key)


def _cached_table(path: Path, key: dict) -> SPSTable | None:
    data = _read_cache(path, key)
    try:
        return SPSTable(tuple(data["sps"])) if data is not None else None
    except (KeyError, TypeError, ValueError, DsparkError):
        return None  # unreadable cache: measure again


def _read_cache(path: Path, key: dict) -> dict | None:
    """The cached JSON object at `path` if it exists, parses and was written for `key`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def _write_cache(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


@torch.inference_mode()
def measure_draft_cost(drafter, target: Target, context: int = 256, reps: int = 10) -> float:
    """Median seconds of one drafting pass (`propose` of a full block) after `context` tokens."""
    model = target.model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (1, context), generator=gen)
    out = model(ids, model.new_cache(1, context), taps=tuple(drafter.tap_layers))
    drafter.begin(ids[0].tolist())
    drafter.observe(ids[0].tolist(), out.taps[0])
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        drafter.propose(int(ids[0, -1]), drafter.num_draft_tokens, SamplingParams(), gen)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        if rep:  # the first pass warms up
            times.append(time.perf_counter() - t0)
    drafter.begin([])
    return statistics.median(times)


def load_or_measure_draft_cost(drafter, target: Target, context: int = 256) -> float:
    """The cached draft-pass time of this drafter shape on this setup, or a fresh measurement.
    Cached (like SPS) so that decisions made from it, and seeded outputs, repeat run to run."""
    context = fit_context(target, context, drafter.block_size)
    key = profile_key(target, drafter.num_draft_tokens, context)
    key["drafter"] = {"class": type(drafter).__name__, "params": sum(p.numel() for p in drafter.model.parameters()),
                      "taps": list(drafter.tap_layers)}
    path = cache_file(key, prefix="draft-")
    data = _read_cache(path, key)
    if data is not None and isinstance(data.get("seconds"), float) and data["seconds"] > 0:
        return data["seconds"]
    seconds = measure_draft_cost(drafter, target, context)
    _write_cache(path, {"key": key, "seconds": seconds})
    return seconds


def parse_sps(text: str) -> SPSTable:
    """`B:sps,B:sps,...` (every B from 1 to the largest given) or a JSON file written by `dspark profile`."""
    path = Path(text).expanduser()
    if ":" not in text and path.is_file():
        try:
            data = json.loads(path.read_text())
            return SPSTable(tuple(float(v) for v in (data["sps"] if isinstance(data, dict) else data)))
        except (ValueError, KeyError, TypeError) as e:
            raise DsparkError(f"{path}: not an SPS table ({e})") from None
    if ":" not in text:
        raise DsparkError(f"--sps: {text} is neither an existing JSON file nor B:steps_per_s pairs")
    try:
        pairs = dict((int(b), float(v)) for b, v in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise DsparkError(f"--sps expects B:steps_per_s pairs like '1:20,2:19.5,3:19' or a JSON file, got {text!r}") from None
    missing = [b for b in range(1, max(pairs) + 1) if b not in pairs]
    if missing:
        raise DsparkError(f"--sps misses batch sizes {missing[:10]}: give every B from 1 to {max(pairs)}")
    return SPSTable(tuple(pairs[b] for b in range(1, max(pairs) + 1)))


def plot_sps(table: SPSTable, png: Path, title: str) -> None:
    plt = pyplot()
    b = list(range(1, table.max_tokens + 1))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(b, table.values, "o-", ms=3)
    axes[0].set(title="target steps per second", xlabel="verify tokens B", ylabel="SPS(B)")
    axes[1].plot(b, [x * v for x, v in zip(b, table.values)], "o-", ms=3)
    axes[1].set(title="tokens per second if all were accepted", xlabel="verify tokens B", ylabel="B·SPS(B)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
