"""The compiled runner: the target's forward over a few tokens of one sequence, built once per machine by
AOTInductor and loaded in about a second.

`StepGraph` is transformer.py's bf16 forward (the same numerics: RMSNorm as one fp32 scale per row with
its weight folded into the next projection, RoPE on interleaved pairs) written for `torch.export`: one
sequence, ROWS tokens at positions `pos`, each layer writing its K/V into that layer's buffer at the
tokens' slots and attending to the buffer in two parts merged as one softmax: the far context through
SDPA, and each token's last ROWS positions gathered along its own path (a chain's rows, or a tree
token's ancestors, wherever their K/V sit). Inductor compiles it with the weights
frozen in (`freezing`) and, with AMX or for int8 weights, its C++ GEMM templates (`max_autotune`, CPP
backend: micro-kernels generated for these shapes; elsewhere oneDNN's prepacked products, measured as
fast), so ~120 projections and ~1,000 small eager ops become one call. `HeadGraph` is the LM head,
compiled the same way.

Verify invariance: every call has the same shapes, ROWS tokens (the real ones, padded with copies of
the last, which compute the same K/V for the same position) over the request's whole K/V window (the
single-request decoder sizes it to prompt + max tokens). So a token's logits do not depend on how many
tokens share its forward or where the window ends: the same kernels, blocking and reduction order run
for plain decoding and for verification, and at temperature 0 speculative decoding is token-identical
to plain decoding in this mode (tests/test_compiled.py). The path-gathered near part makes this hold
for trees too: a token deep in a tree attends to the same K/V in the same order as when decoded
alone, where one SDPA over the window would sum them in slot order, which a tree scatters. Inductor
picks a GEMM's blocking from its row count (and oneDNN and the SDPA kernel from theirs and the attended length), so a step with dynamic
shapes was measured not to be: logits moved by up to 2-30 between 1- and 16-token forwards on random
tokens. The price is a ROWS-token forward for every plain step, which the flat cost curve makes small.

Artifacts live under the dspark cache, keyed by the model, the CPU's flags, torch's version and
COMPILED_VERSION (`artifact_dir`); `compile_runner` builds them (`dspark compile`), `load_runner` finds
them (None when absent: the eager runner stays the reference and the fallback). `dspark compile` then times
the runner against the eager one (`record_timing`); `--runner auto` passes over a runner measured slower (on
an AVX2-only CPU, whose bf16 products have no native instructions, the compiled bf16 step ran 2.6x slower).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspark.errors import DsparkError
from dspark.util.cache import cache_root
from dspark.util.files import atomic_write_text
from dspark.util.journal import json_digest
from dspark.util.platform import cpu_flags

COMPILED_VERSION = 4  # bumped when StepGraph / HeadGraph or their compile options change
WEIGHTS = ("bf16", "int8")  # how the compiled runner stores the projections' weights (see Projection)
ROWS = 9  # tokens in every compiled call: an anchor and 8 drafts (more run eager: prefills, longer blocks)
INDUCTOR_OPTIONS = {
    "freezing": True,  # weights become constants: GEMM templates prepack them at compile time
    "max_autotune": True,
    # Inductor's generated micro-kernels, timed beside ATen's products (which won none of these shapes
    # on the AMX Xeon, at 20-80% of their speed) and taken where no micro-kernel fits the CPU
    "max_autotune_gemm_backends": "CPP,ATEN",
}
# bf16 with AVX512-BF16 but no AMX (an EPYC): frozen weights in oneDNN's prepacked products, no autotuning. There the
# templates won nothing: a 9-token forward with its logits took 16.6 and 16.9 ms (two packages) against 17.3 ms
# with autotuning (interleaved in one process; eager 22.9 ms), and compiling took 88-95 s against ~120 s. int8
# keeps the templates (its 9-token step 32.6 ms; ATen's int8 product 41.8 ms).
ONEDNN_OPTIONS = {"freezing": True}


def inductor_options(weights: str) -> dict:
    """The Inductor options `compile_runner` builds `weights` with on this CPU (measured, see above)."""
    flags = cpu_flags()
    native_without_amx = "avx512_bf16" in flags and "amx_bf16" not in flags  # AVX2-only CPUs: not measured, templates
    return ONEDNN_OPTIONS if weights == "bf16" and native_without_amx else INDUCTOR_OPTIONS


class StepGraph(nn.Module):
    """The target's forward over k tokens of one sequence (see the module docstring).

    forward(ids [k], pos [k], slots [k], path_slots [k, k], on_path [k, k] bool,
            *kv: L_layers x [2 * kv_heads, S, head_dim])
      -> hidden [k, H] (after the final norm), states [k, layers + 1, H] (the embedding output, then each
         decoder layer's output: what the drafters tap).
    Row i is at RoPE position pos[i] and writes its K/V to slot slots[i]. It attends to the slots before
    position pos[i] - k + 1 (committed tokens: slot = position) and to its last k positions, whose K/V
    sit in slots path_slots[i] (committed ones, or this call's rows on its path), where on_path[i]."""

    def __init__(self, model, weights: str = "bf16"):
        super().__init__()
        c = model.cfg
        if model.dtype != torch.bfloat16 or model._kernels is None or not model._kernels[0].fold_norms:
            raise DsparkError("the compiled runner is built from the bfloat16 model prepared unpacked")
        if c.qk_norm or model._kernels[0].qkv.bias is not None:
            raise DsparkError(f"the compiled runner does not cover {c.family} models yet (q/k norms or qkv bias)")
        frozen = lambda t: nn.Parameter(t.detach().clone(), requires_grad=False)
        self.nh, self.nkv, self.hd, self.eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        self.embed = frozen(model.embed_tokens)
        self.norm = frozen(model.norm)
        self.wqkv, self.wo, self.w_gate_up, self.w_down = (
            nn.ModuleList([Projection(getattr(k, name).weight, weights) for k in model._kernels])
            for name in ("qkv", "o", "gate_up", "down"))
        self.register_buffer("rope", torch.view_as_real(model.rope_cis).clone())  # [positions, d / 2, 2]

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rotated(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on interleaved pairs (transformer.py's complex product, in real arithmetic)."""
        pairs = qk.float().unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(qk.dtype)

    def forward(self, ids, pos, slots, path_slots, on_path, *kv):
        k, width = ids.shape[0], kv[0].shape[1]  # k = ROWS; width = S
        nh, nkv, hd = self.nh, self.nkv, self.hd
        group = nh // nkv
        rope = self.rope[pos][:, None]  # [k, 1, d / 2, 2]
        cos, sin = rope[..., 0], rope[..., 1]
        # row i's far context: the slots before its last `k` positions, as SDPA's additive mask (query
        # heads folded into rows: folded row g * k + i is row i)
        far = torch.arange(width)[None] < (pos - (k - 1))[:, None]  # [k, S]
        far_bias = torch.zeros(k, width, dtype=torch.bfloat16).masked_fill(~far, float("-inf"))
        far_bias = far_bias[None].expand(group, k, width).reshape(1, 1, group * k, width)
        has_far = pos > k - 1  # rows within the first k positions have none
        near_bias = torch.zeros(k, k).masked_fill(~on_path, float("-inf"))  # [row, near position]
        x = F.embedding(ids, self.embed)
        states = [x]
        for li, buf in enumerate(kv):
            qkv = self.wqkv[li](self._normed(x)).view(k, nh + 2 * nkv, hd)
            qk = self._rotated(qkv[:, : nh + nkv], cos, sin)
            buf[:, slots] = torch.cat([qk[:, nh:], qkv[:, nh + nkv:]], 1).transpose(0, 1)
            q = qk[:, :nh].view(k, nkv, group, hd).permute(1, 2, 0, 3)  # [nkv, group, k, hd]
            attn = self._attention(q, buf, far_bias, has_far, buf[:, path_slots], near_bias)
            x = x + self.wo[li](attn.permute(2, 0, 1, 3).reshape(k, nh * hd))
            gate, up = self.w_gate_up[li](self._normed(x)).chunk(2, dim=-1)
            x = x + self.w_down[li](F.silu(gate) * up)
            states.append(x)
        return self._normed(x) * self.norm, torch.stack(states, dim=1)

    def _attention(self, q, buf, far_bias, has_far, near, near_bias):
        """Attention of each row to its far context (SDPA over the window, with its log-sum-exp) and to
        its last k positions (`near` [2 * nkv, k, k, hd]: the K/V of its path's positions in order,
        gathered from wherever they sit), merged exactly as one softmax over both. A row's numbers
        depend on its position and path alone: the same whether it is decoded alone, verified in a
        chain or deep in a tree with its ancestors' K/V in scattered slots."""
        nkv, group, k, hd = q.shape
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.reshape(1, nkv, group * k, hd), buf[None, :nkv], buf[None, nkv:], 0.0, False, attn_mask=far_bias)
        out, lse = out.view(nkv, group, k, hd).float(), lse.view(nkv, group, k)
        lse = torch.where(has_far, lse, float("-inf"))  # SDPA gives a row it masks whole lse 0, output 0
        scores = torch.einsum("ngid,nijd->ngij", q.float(), near[:nkv].float()) * hd ** -0.5 + near_bias
        near_lse = torch.logsumexp(scores, -1)
        near_out = torch.einsum("ngij,nijd->ngid", torch.exp(scores - near_lse[..., None]), near[nkv:].float())
        total = torch.logaddexp(lse, near_lse)
        merged = out * torch.exp(lse - total)[..., None] + near_out * torch.exp(near_lse - total)[..., None]
        return merged.to(torch.bfloat16)


class HeadGraph(nn.Module):
    """The LM head: hidden [n, H] -> fp32 logits [n, V]."""

    def __init__(self, model, weights: str = "bf16"):
        super().__init__()
        self.head = Projection(model.lm_head, weights)

    def forward(self, hidden):
        return self.head(hidden).float()


class Projection(nn.Module):
    """x @ W.T for one frozen weight, stored as `weights` says: "bf16" as it is, or "int8" weight-only
    (one scale per output channel, max |W| / 127 rounded to bf16, then W / scale rounded), the form
    Inductor's C++ GEMM template takes for int8 weights (`_weight_int8pack_mm`, scale as an epilogue)."""

    def __init__(self, weight: torch.Tensor, weights: str):
        super().__init__()
        if weights not in WEIGHTS:
            raise DsparkError(f"unknown compiled weight format {weights!r}; choose one of {list(WEIGHTS)}")
        self.int8 = weights == "int8"
        w = weight.detach()
        if self.int8:
            w = w.float()
            scale = (w.abs().amax(dim=1).clamp(min=1e-8) / 127).to(torch.bfloat16)
            self.register_buffer("weight", torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8))
            self.register_buffer("scale", scale)
        else:
            self.weight = nn.Parameter(w.clone(), requires_grad=False)

    def forward(self, x):
        if self.int8:
            return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
        return F.linear(x, self.weight)


def artifact_key(model_dir: Path, weights: str = "bf16") -> dict:
    """What a compiled runner depends on: the weights (their files' sizes and times) and their format,
    the CPU, the threads its kernels were blocked for, torch, and this module's version."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix == ".safetensors")
    return {
        "model": str(model_dir.resolve()),
        "format": weights,
        "weights": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "cpu": cpu_flags(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "version": COMPILED_VERSION,
    }


def artifact_dir(model_dir: Path, weights: str = "bf16", key: dict | None = None) -> Path:
    """Where the runner for `artifact_key(model_dir, weights)` (or the `key` already computed) lives."""
    key = key or artifact_key(model_dir, weights)
    return cache_root() / "compiled" / f"{model_dir.name}-{weights}-{json_digest(key)}"


def runs_compiled(model) -> bool:
    """Whether a compiled runner can serve `model`: bf16 on a CPU (what `load_target` attaches it to)."""
    return model.precision == "bfloat16" and model.device.type == "cpu"


def compile_runner(model, model_dir: Path, weights: str = "bf16", say=print, rows: int = ROWS) -> Path:
    """Export and compile `model` (bf16, prepared unpacked) for this machine, its projections stored as
    `weights` (WEIGHTS), every call `rows` tokens; returns the artifact directory. Takes minutes
    (Inductor times its candidate kernels for every product); `say` reports each stage."""
    import torch._inductor as inductor

    key = artifact_key(model_dir, weights)
    out = artifact_dir(model_dir, weights, key)
    options = inductor_options(weights)
    kernels = "Inductor's GEMM templates, timed on this CPU" if options.get("max_autotune") else "oneDNN's products"
    out.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    step, head = StepGraph(model, weights).eval(), HeadGraph(model, weights).eval()
    window = torch.export.Dim("window", min=rows + 1, max=model.max_positions)
    example_width = 2 * rows + 1  # any window > rows: the export's example, dynamic in the package
    kv = [torch.zeros(2 * c.num_key_value_heads, example_width, c.head_dim, dtype=torch.bfloat16)
          for _ in range(c.num_hidden_layers)]
    ids, pos = torch.zeros(rows, dtype=torch.long), torch.arange(example_width - rows, example_width)
    path_slots, on_path = near_slots(example_width - rows, *chain_layout(rows), rows)
    started = time.perf_counter()
    with torch.no_grad():
        say("exporting the decode step and the LM head (torch.export)")
        programs = {
            "step": torch.export.export(step, (ids, pos, pos.clone(), path_slots, on_path, *kv),  # two inputs, not one
                                        dynamic_shapes={"ids": None, "pos": None, "slots": None, "path_slots": None,
                                                        "on_path": None, "kv": ({1: window},) * len(kv)}),
            "head": torch.export.export(head, (torch.zeros(rows, c.hidden_size, dtype=torch.bfloat16),)),
        }
        for name, program in programs.items():
            say(f"compiling {name}.pt2 ({kernels}; minutes)")
            partial = out / f"{name}.partial.pt2"
            inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
            os.replace(partial, out / f"{name}.pt2")
    meta = {"key": key, "rows": rows, "inductor": options, "compile_s": round(time.perf_counter() - started, 1),
            "bytes": sum(p.stat().st_size for p in out.glob("*.pt2"))}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    record_exact_rows(model_dir, weights, c, say)
    return out


def record_exact_rows(model_dir: Path, weights: str, cfg, say=print) -> int:
    """Measure which of the built runner's rows compute exactly as its first and store it in meta.json."""
    say("checking which rows of a call compute a token exactly as a 1-token call does")
    exact = measure_exact_rows(CompiledRunner(artifact_dir(model_dir, weights), cfg), cfg)
    update_meta(model_dir, weights, exact_rows=exact)
    return exact


class CompiledRunner:
    """The loaded artifacts, called by `TargetModel.forward` / `.logits` for what they cover."""

    def __init__(self, directory: Path, cfg):
        import torch._inductor as inductor

        try:
            self.step = inductor.aoti_load_package(str(directory / "step.pt2"))
            self.head = inductor.aoti_load_package(str(directory / "head.pt2"))
        except (RuntimeError, OSError, ValueError) as e:  # a truncated or foreign file: say what to do
            raise DsparkError(f"cannot load the compiled runner in {directory} ({type(e).__name__}: {e}); "
                              "delete that directory and run `dspark compile` again") from None
        self.layers = cfg.num_hidden_layers
        meta = _meta_in(directory)
        if not isinstance(meta.get("rows"), int):
            raise DsparkError(f"the compiled runner in {directory} has no readable meta.json; delete that directory "
                              "and run `dspark compile` again")
        self.rows = meta["rows"]
        self.exact_rows = meta.get("exact_rows", self.rows)  # measured by `dspark compile` (measure_exact_rows)

    def covers(self, q: int, window: int) -> bool:
        """Whether the step runs q tokens of one sequence whose K/V window is `window` positions."""
        return q <= self.rows < window

    def forward(self, input_ids: torch.Tensor, kv: list[torch.Tensor], start: int, taps: tuple[int, ...],
                tree: tuple[torch.Tensor, torch.Tensor] | None = None):
        """input_ids [1, q] after `start` committed tokens of the one-row cache `kv` -> (hidden [1, q, H],
        taps [1, q, m, H] or None); a chain, or the tree `tree` (TargetModel.forward's). The q tokens
        are padded to `rows` with copies of the last (see the module docstring)."""
        q = input_ids.shape[1]
        depth, visible = chain_layout(q) if tree is None else tree
        ids, pos = _padded(input_ids[0], self.rows), start + _padded(depth, self.rows)
        # the padding rows write their K/V past the real ones where the window has room (the decoder leaves
        # ROWS - 1 positions of it): a slot written twice in one call keeps either row's K/V, and rows that
        # round apart (measure_exact_rows) would make the kept one, and decoding, nondeterministic
        slots = torch.arange(start, start + self.rows)
        slots[q:] = torch.where(slots[q:] < kv[0].shape[-2], slots[q:], start + q - 1)
        path_slots, on_path = (_padded(t, self.rows) for t in near_slots(start, depth, visible, self.rows))
        hidden, states = self.step(ids, pos, slots, path_slots, on_path, *[t[0] for t in kv])
        hidden = hidden[:q]
        if not taps:
            return hidden[None], None
        # states[:, 0] is the embedding output (tap -1); the last layer is tapped after the final norm
        tapped = [hidden if t == self.layers - 1 else states[:q, t + 1] for t in taps]
        return hidden[None], torch.stack(tapped, dim=1)[None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of hidden [..., H], or None for more than `rows` rows (padded like `forward`)."""
        rows = hidden.reshape(-1, hidden.shape[-1]).to(torch.bfloat16)
        n = rows.shape[0]
        if not 1 <= n <= self.rows:
            return None
        logits = self.head(_padded(rows, self.rows))
        return logits[:n].view(*hidden.shape[:-1], -1)


def chain_layout(q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth, visibility) of q tokens in a chain, as a tree's (`DraftTree.attention`): each sees those before."""
    return torch.arange(q), torch.ones(q, q, dtype=torch.bool).tril()


def near_slots(start: int, depth: torch.Tensor, visible: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """StepGraph's (path_slots, on_path) [q, rows] for q tokens after `start` committed ones, token i at
    depth[i] seeing the tokens visible[i] marks (its ancestors and itself; tokens numbered parents first):
    the slots of positions pos_i - rows + 1 .. pos_i on its path — committed slots before `start`, its
    ancestors' (in depth order) and its own after — and whether each position exists (>= 0)."""
    q = depth.shape[0]
    ancestors = torch.where(visible, torch.arange(q), q).sort(1).values  # [q, q]: by depth, then q
    position = start + depth[:, None] - (rows - 1) + torch.arange(rows)[None]  # [q, rows]
    in_call = position >= start
    ancestor = ancestors.gather(1, (position - start).clamp(min=0, max=q - 1))
    return torch.where(in_call, start + ancestor, position.clamp(min=0)), position >= 0


def measure_exact_rows(runner: CompiledRunner, cfg, trials: int = 256, seed: int = 0) -> int:
    """How many leading rows of a call compute a token exactly as row 0 does: the most tokens a
    forward may verify with the runner's verify invariance. Each trial puts one random token at a
    random position in every row over random K/V and finds the first row whose outputs differ from
    row 0's (on an AVX2-only CPU the 9th row, the GEMM templates' M tail, rounded a layer's output
    1 bf16 ulp apart once in ~40 decoded tokens; AVX512 and AMX kernels measured exact in all 9)."""
    g = torch.Generator().manual_seed(seed)
    width, exact = 4 * runner.rows, runner.rows
    shape = (2 * cfg.num_key_value_heads, width, cfg.head_dim)
    for _ in range(trials):
        kv = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(runner.layers)]
        start = int(torch.randint(runner.rows, width - runner.rows, (1,), generator=g))
        ids = torch.randint(0, cfg.vocab_size, (1,), generator=g).repeat(runner.rows)  # contiguous
        pos = torch.full((runner.rows,), start)
        path_slots, on_path = (_padded(t, runner.rows) for t in near_slots(start, *chain_layout(1), runner.rows))
        hidden, states = runner.step(ids, pos, torch.arange(start, start + runner.rows), path_slots, on_path, *kv)
        same = (states == states[:1]).flatten(1).all(1) & (hidden == hidden[:1]).all(1)
        exact = min(exact, int(same.long().cumprod(0).sum()))
    return exact


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, ...] with its last row repeated to `rows` rows (n <= rows), contiguous."""
    return torch.cat([x, x[-1:].expand(rows - x.shape[0], *x.shape[1:])])


def load_runner(model_dir: Path, cfg, weights: str = "bf16", only_if_faster: bool = False) -> CompiledRunner | None:
    """This machine's compiled runner for the model in `model_dir` with `weights`, or None where
    `dspark compile` has not built it (or, `only_if_faster`, where it measured slower than eager)."""
    if not runner_built(model_dir, weights) or (only_if_faster and faster_than_eager(model_dir, weights) is False):
        return None
    return CompiledRunner(artifact_dir(model_dir, weights), cfg)


def runner_built(model_dir: Path, weights: str = "bf16") -> bool:
    return (artifact_dir(model_dir, weights) / "meta.json").is_file()


def read_meta(model_dir: Path, weights: str = "bf16") -> dict:
    """This machine's runner's meta.json ({} where absent or unreadable)."""
    return _meta_in(artifact_dir(model_dir, weights))


def _meta_in(directory: Path) -> dict:
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def faster_than_eager(model_dir: Path, weights: str = "bf16") -> bool | None:
    """Whether `dspark compile` measured this machine's compiled runner faster than the eager bf16 one
    (None: not built, or built before the comparison was recorded)."""
    return read_meta(model_dir, weights).get("faster_than_eager")


def update_meta(model_dir: Path, weights: str, **fields) -> None:
    """Add `fields` to this machine's runner's meta.json (atomically)."""
    meta = {**read_meta(model_dir, weights), **fields}
    atomic_write_text(artifact_dir(model_dir, weights) / "meta.json", json.dumps(meta, indent=1))


def record_timing(model_dir: Path, weights: str, ms: dict[str, dict[int, float]]) -> bool:
    """Store `ms` ({"compiled" / "eager": {tokens: ms a forward with logits}}) and the verdict in the
    runner's meta.json; returns the verdict: faster at every size timed."""
    faster = all(ms["compiled"][k] < ms["eager"][k] for k in ms["eager"])
    update_meta(model_dir, weights, faster_than_eager=faster,
                timing_ms={name: {str(k): round(v, 2) for k, v in t.items()} for name, t in ms.items()})
    return faster
