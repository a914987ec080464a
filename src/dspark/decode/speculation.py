"""What a `--drafter` / `--policy` value names -> (drafter, verification policy, engine), for every command.

One grammar: `DRAFTER[@POLICY]`, DRAFTER = auto | none | prompt-lookup | PATH to a checkpoint directory,
auto and PATH optionally `+lookup` (prompt-lookup branches in their trees: tree policies only, `tree` by
default), POLICY = ar | full | fixed:K | threshold:C | tree | tree:N | dspark | dspark-async
(`schedule/policies.py`); `--policy POLICY` says the same apart. `auto` is the drafter dspark ships for
the target (else prompt lookup): alone, with prompt-lookup branches under the `tree` policy, in every
command (`AUTO`); `auto@POLICY` is it with POLICY. A path alone verifies every draft (`full`) in
`generate` / `eval`, and `serve` defaults to `dspark`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dspark.decode.engine import Engine
from dspark.draft.base import Drafter
from dspark.draft.checkpoint import wrap_drafter
from dspark.draft.dspark import DSparkModel
from dspark.draft.hybrid import SUFFIX, LookupBranchDrafter
from dspark.draft.layers import ModelDrafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.draft.registry import MODEL_FREE, bundled_drafter, checkpoint_digest, load_named_drafter
from dspark.errors import DsparkError
from dspark.model.target import Target
from dspark.schedule.policies import POLICIES, POLICY_NAMES, DSparkPolicy, Policy, SPSTable, parse_policy
from dspark.schedule.sps import load_or_measure, load_or_measure_draft_cost

DRAFTER_CHOICES = ("auto | none | prompt-lookup | PATH to a drafter checkpoint directory (auto and PATH optionally "
                   "+lookup), each optionally @POLICY")
ENGINE_PROMPT_LOOKUP_DRAFTS = 8  # drafts per row of the batched engine's prompt-lookup drafter
TREE_MAX_TOKENS = 33  # the SPS curve `tree` reads: trees of up to 32 drafts
REQUEST_MAX_PROBE_EVERY = 32  # the draft gate's longest wait between probes, one request at a time
# what `auto` adds to the bundled drafter: the hardware's tree with prompt-lookup branches, one request at a
# time (generate, eval) and in the engine (serve), where its trees shrink to chains and to nothing as the
# batch grows (benchmarks/results/README.md, "lookup branches in the engine")
AUTO = SUFFIX + "@tree"
EngineFactory = Callable[[Policy, int], Engine]  # (policy, max_batch) -> Engine


def engine_curve_tokens(policy: str, rows: int, max_drafts: int) -> int | None:
    """How far the SPS curve an engine of `rows` rows reads under `policy` must reach (every row verifying
    all its drafts; a tree's 32 drafts), or None for the policies that do not read it."""
    if policy not in ("dspark", "dspark-async", "tree"):
        return None
    return min(256, max(rows * (max_drafts + 1), TREE_MAX_TOKENS if policy == "tree" else 0))


# ---- the grammar ------------------------------------------------------------------------------
def check_policy(rule: str, where: str = "") -> tuple[str, str]:
    """A policy spelling's (name, argument); a clear error names the spellings there are."""
    name, _, arg = rule.partition(":")
    if name not in POLICY_NAMES or (arg and name not in ("fixed", "threshold", "tree")):
        raise DsparkError(f"unknown verification rule {rule!r}{where}; a policy is one of {POLICIES}")
    try:
        parse_policy(rule, SPSTable((1.0,)))
    except DsparkError as e:
        raise DsparkError(f"{e}{where}") from None
    return name, arg


def split_spec(spec: str, default: str = "full") -> tuple[str, str]:
    """`DRAFTER@POLICY` -> (DRAFTER, POLICY), POLICY `default` when not given (`tree` for a drafter with
    prompt-lookup branches: `auto+lookup`, `PATH+lookup`). A path containing `@` is a path."""
    base, sep, rule = spec.rpartition("@")
    if not sep or Path(spec).exists():
        return spec, "tree" if spec.endswith(SUFFIX) else default
    check_policy(rule, f" in {spec!r}")
    return base, rule


def with_policy(spec: str, policy: str | None) -> str:
    """The --drafter value with a --policy given apart folded in (`DRAFTER@POLICY`); both given and
    different is an error."""
    if policy is None or spec == "none":
        return spec
    check_policy(policy, " (--policy)")
    base, sep, rule = spec.rpartition("@")
    if sep and not Path(spec).exists():
        if rule != policy:
            raise DsparkError(f"--drafter {spec!r} and --policy {policy} name two policies; give it once")
        return spec
    return f"{spec}@{policy}"


def check_drafter_spec(spec: str | None) -> None:
    """Fail early (before a model loads) on a --drafter value that names nothing."""
    if spec in (None, "auto", *MODEL_FREE) or Path(spec).exists():
        return
    base, _ = split_spec(spec)
    name = base.removesuffix(SUFFIX)
    if name != base and name in MODEL_FREE:
        raise DsparkError(f"drafter {spec!r}: `{SUFFIX}` adds prompt-lookup branches to a model drafter's trees "
                          f"(auto{SUFFIX} or PATH{SUFFIX})")
    if name not in ("auto", "prompt-lookup") and not Path(name).expanduser().exists():
        raise DsparkError(f"drafter {spec!r} is neither a known drafter ({DRAFTER_CHOICES}) nor an existing path")


def resolve_drafter_spec(spec: str | None, target: Target, auto: str = AUTO) -> str | None:
    """`auto` becomes the bundled drafter of `target` + `auto` (default `AUTO`: `PATH+lookup@tree`),
    `auto@POLICY` `PATH@POLICY`,
    `auto+lookup[@POLICY]` `PATH+lookup@POLICY` (tree when not given); prompt-lookup when dspark ships none."""
    if spec is None or Path(spec).exists():
        return spec
    base, rule = split_spec(spec, "tree")
    if base not in ("auto", "auto" + SUFFIX):
        return spec
    path = bundled_drafter(target)
    if path is None:
        return "prompt-lookup"
    return f"{path}{auto}" if spec == "auto" else f"{path}{base.removeprefix('auto')}@{rule}"


def spec_policy(spec: str | None) -> str:
    """The policy of a (resolved) --drafter value: DRAFTER@POLICY's POLICY, else full."""
    return split_spec(spec)[1] if spec not in (None, "none") else "full"


def drafter_digest(spec: str) -> str:
    """A drafter's identity for resumable runs: a checkpoint's config and weights with its policy,
    or the name of a model-free drafter."""
    base, rule = split_spec(spec)
    path = Path(base)
    return f"{checkpoint_digest(path)}@{rule}" if path.is_dir() else spec


# ---- loading ----------------------------------------------------------------------------------
def load_drafter(spec: str | None, target: Target, num_draft_tokens: int | None = None) -> Drafter | None:
    """The drafter a --drafter value names (its `@POLICY` is the policy's business: `spec_policy`)."""
    spec = resolve_drafter_spec(spec, target)
    if spec is None:
        return None
    check_drafter_spec(spec)
    return load_named_drafter(split_spec(spec)[0], target, num_draft_tokens)


def load_speculation(spec: str | None, target: Target, num_draft_tokens: int | None = None,
                     confidence_threshold: float | None = None, auto: str = AUTO):
    """(resolved spec, drafter or None, policy) for one request at a time (`generate`, `eval`);
    a bare `auto` is the bundled drafter + `auto`."""
    spec = resolve_drafter_spec(spec, target, auto)
    drafter = load_drafter(spec, target, num_draft_tokens)
    return spec, drafter, request_policy(spec_policy(spec), drafter, target, confidence_threshold)


def request_policy(rule: str, drafter: Drafter | None, target: Target,
                   confidence_threshold: float | None = None) -> Policy:
    """The single-request policy `rule` for `drafter` (None: plain AR) on `target`; the dspark policies
    count the drafter's own pass in each step's time. `confidence_threshold` (--confidence-threshold)
    is the policy threshold:C given apart."""
    if drafter is None:
        return parse_policy("ar")
    name, arg = check_policy(rule)
    if isinstance(drafter, LookupBranchDrafter):
        if name != "tree":
            raise DsparkError(f"`{SUFFIX}` adds branches to token trees: verify them with @tree or @tree:N, not {rule}")
        drafter = drafter.drafter  # whose pass the policy times
    if confidence_threshold is not None:
        if name == "threshold":
            raise DsparkError(f"the rule {rule!r} already sets a threshold; drop --confidence-threshold")
        if name.startswith("dspark") or name == "tree":
            raise DsparkError(f"the {name} verification rule and --confidence-threshold exclude each other")
        name, rule = "threshold", f"threshold:{confidence_threshold}"
    if name in ("threshold", "dspark", "dspark-async") and not drafter.has_confidence:
        raise DsparkError(f"this drafter has no confidence head: the {name} verification rule needs one")
    hardware = name.startswith("dspark") or rule == "tree"  # the policies that read the SPS curve
    if not hardware:
        return limited_policy(target, rule, None, drafter.max_drafts)
    draft_s = load_or_measure_draft_cost(drafter, target)
    max_tokens = TREE_MAX_TOKENS if name == "tree" else drafter.max_drafts + 1
    sps = load_or_measure(target, max_tokens=max_tokens, progress=False)[0]
    policy = limited_policy(target, name, sps, drafter.max_drafts)
    assert isinstance(policy, DSparkPolicy)
    policy.gate.draft_seconds = lambda requests: draft_s
    # a lone request's gate probes at least every REQUEST_MAX_PROBE_EVERY skipped steps: content that turns
    # predictable is found within that (the engine's 256 locked a lone request out for hundreds of steps on
    # an AMX Xeon), and where drafting never pays a probe costs under 1% (an AVX2 EPYC: ~3.5 ms in 32 steps)
    policy.gate.max_probe_every = REQUEST_MAX_PROBE_EVERY
    return policy


def engine_factory(target: Target, drafter_spec: str | None, max_len: int | None = None,
                   prefix_cache_bytes: int = 0) -> tuple[EngineFactory, str, int]:
    """(make(policy, max_batch) -> Engine, drafter label, drafts per row at most) for a resolved
    --drafter value without its policy. `max_len` bounds each slot's context (the KV cache is
    allocated for max_batch x max_len up front); `prefix_cache_bytes` > 0 gives the engines a prompt
    prefix cache of that size."""
    def make(drafters=None, **kw) -> EngineFactory:
        return lambda policy, c: Engine(target, drafters, policy, max_batch=c, max_len=max_len,
                                        prefix_cache_bytes=prefix_cache_bytes, **kw)

    if drafter_spec in (None, "none"):
        return make(), "none", 0
    if drafter_spec == "prompt-lookup":
        return (make(lambda: PromptLookupDrafter(ENGINE_PROMPT_LOOKUP_DRAFTS)), drafter_spec,
                ENGINE_PROMPT_LOOKUP_DRAFTS)
    drafter = load_drafter(drafter_spec, target)
    lookup = isinstance(drafter, LookupBranchDrafter)  # `+lookup`: each row's trees take its lookup branch
    if lookup:
        drafter = drafter.drafter
    model = drafter.model if isinstance(drafter, ModelDrafter) else None
    if isinstance(model, DSparkModel):  # DSpark / DFlash: one batched drafting pass per step
        return (make(draft_model=model, temperatures=drafter.temperatures, lookup_branches=lookup), drafter_spec,
                drafter.max_drafts)
    # EAGLE-3: one drafter per request, sharing the weights
    return make(lambda: wrap_drafter(model, target), lookup_branches=lookup), drafter_spec, drafter.max_drafts


def limited_policy(target: Target, rule: str, sps: SPSTable | None, max_drafts: int) -> Policy:
    """`parse_policy(rule, sps)` within the target's `verify_limit` (what it verifies exactly a forward): the
    hardware's curve cut there, so that its rules never verify past it, and a fixed-size rule that can
    verify more tokens a forward (with `max_drafts` drafts a round) refused, saying what fits."""
    limit = target.model.verify_limit
    if limit is None:
        return parse_policy(rule, sps)
    if sps is not None:
        return parse_policy(rule, SPSTable(sps.values[:limit]))
    drafts = _most_drafts(rule, max_drafts)
    if 1 + drafts > limit:
        precision = target.model.precision
        why, instead = (("`dspark compile` measured its compiled runner on this CPU",
                         "--dtype bfloat16" if precision == "int8" else "--runner eager") if target.model.compiled
                        else ("its decode-attention kernel's token trees", "--dtype float32"))
        raise DsparkError(f"{precision} verifies at most {limit} tokens a forward exactly ({why}), and {rule} with this "
                          f"drafter verifies up to {1 + drafts}: use tree:{limit - 1}, fixed:{limit - 1}, "
                          f"--num-draft-tokens {limit - 1} or the hardware's rules (tree, dspark), or {instead}")
    return parse_policy(rule)


def _most_drafts(rule: str, max_drafts: int) -> int:
    """The most drafts a fixed-size rule verifies in one round of a drafter with `max_drafts`."""
    name, arg = check_policy(rule)
    if name == "ar":
        return 0
    if name == "tree":
        return int(arg)
    return min(int(arg), max_drafts) if name == "fixed" else max_drafts
