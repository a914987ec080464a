"""Training configuration: a TOML or YAML file, plus `--set key=value` overrides.

Files may use sections ([drafter], [train], [loss]) or flat keys; both map onto `TrainConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

import torch

from dspark.errors import DsparkError

ALGORITHMS = ("dspark", "dflash", "eagle3")
# the distillation losses (DESIGN.md §4): kd = ce_weight · CE + tv_weight · L1, ce = CE on the regenerated
# token, soft_ce = −Σ p_t log p_d; "auto" picks each algorithm's published one
LOSSES = ("auto", "kd", "ce", "soft_ce")
DEFAULT_LOSS = {"dspark": "kd", "dflash": "ce", "eagle3": "soft_ce"}


ALL_ANCHORS = "all"
TARGET_DTYPES = ("float32", "bfloat16", "auto")
COMPILE_LOSS_STEPS = 200  # compile_loss = "auto" compiles runs of this many steps or more
# how a training checkpoint stores the drafter's weights and the AdamW moments
CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class TrainConfig:
    # regenerated data (`dspark data regenerate`): a JSONL file or a shard store directory, or a list of
    # them (e.g. stores of a second reply per prompt, another seed): their samples together
    data: str | list[str] = ""
    val_data: str = ""  # held-out regenerated data to validate on; "" = the id-hash split of `data`
    out: str = "runs/drafter"  # run directory: checkpoint/, final/, log.jsonl, curves.png
    algorithm: str = "dspark"  # dspark (heads) | dflash (backbone only, CE) | eagle3
    target: str = ""  # HF dir / .gguf; "" = embedded SmolLM2
    init: str = ""  # optional drafter checkpoint to start from
    # drafter shape
    block_size: int = 8
    layers: int = 1
    head: str = "vanilla"  # vanilla | gated | rnn (dspark only)
    markov_rank: int = 32
    confidence_head: bool = True
    confidence_head_with_markov: bool = True  # confidence on [h ; W1[prev]] (False: on h alone)
    context_fusion: str = "shared"  # shared: one projection of the taps (DFlash) | layerwise: DFlare's per-layer mix
    draft_layer: str = "qwen3"  # qwen3: DeepSpec's draft layer | target: the target's own (dspark <= 0.1)
    tap_layers: list[int] = dataclasses.field(default_factory=list)  # [] = 5 spread over the depth
    mask_token_id: int = -1  # -1 = automatic
    copy_target_layers: bool = False  # start the draft layers as copies of the target's last layers
    draft_vocab_size: int = 0  # K: draft over the K most frequent response tokens of the training split; 0 = all
    # optimisation
    steps: int = 1000
    batch_size: int = 4  # sequences per optimiser step, summed over all ranks
    grad_accum: int = 1  # micro-batches per step on each rank
    anchors_per_seq: int | str = 16  # anchors sampled per sequence, or "all" (every response position)
    anchor_chunk: int = 64  # anchors per drafter forward: bounds memory; the target's forward runs once per batch
    max_seq_len: int = 512
    group_by_length: bool = True  # batch sequences of similar length (less padding, same epochs)
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    autocast: str = "auto"  # auto (bf16 where the hardware has native bf16) | bf16 | off
    # the loss's [slots, vocabulary] arithmetic compiled by Inductor: auto (for runs of COMPILE_LOSS_STEPS+
    # steps, where the compilation, ~15 s a drafter, pays) | on | off
    compile_loss: str = "auto"
    # the frozen teacher's precision: float32 | bfloat16 | auto (bf16 where the hardware has native bf16:
    # ~3x faster target passes on AMX, and the distribution and features the drafter meets at inference)
    target_dtype: str = "float32"
    device: str = "auto"  # auto (CUDA when available, else CPU) | cpu | cuda | cuda:N
    seed: int = 0
    # losses (DESIGN.md §4)
    loss: str = "auto"  # auto (dspark: kd, dflash: ce, eagle3: soft_ce) | kd | ce | soft_ce
    ce_weight: float = 0.1  # kd: weight of the CE on the regenerated token
    tv_weight: float = 0.9  # kd: weight of the L1 distance to the target's distribution
    conf_weight: float = 1.0  # the confidence head's BCE (drafters with one), under every loss
    # the BCE's gradient also reaches the block backbone and the Markov embeddings it reads (DeepSpec);
    # false: it trains the confidence head alone
    conf_into_backbone: bool = True
    position_decay: float = 4.0  # λ in w_k = exp(-k / λ)
    ttt_steps: int = 7  # eagle3: steps the training-time test unrolls
    ttt_decay: float = 0.8  # eagle3: step weights ttt_decay^k
    # bookkeeping
    checkpoint_every: int = 100
    checkpoint_dtype: str = "float32"  # float32: resume is exact | bfloat16: weights and AdamW moments half the size
    eval_every: int = 100
    val_fraction: float = 0.02
    val_max_samples: int = 64
    threads: int = 0  # 0 = torch default

    def validate(self) -> "TrainConfig":
        if not self.data_paths:
            raise DsparkError("no training data: set `data` to a file made by `dspark data regenerate`")
        if self.algorithm not in ALGORITHMS:
            raise DsparkError(f"unknown algorithm {self.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if self.loss not in LOSSES:
            raise DsparkError(f"unknown loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        if self.block_size < 2:
            raise DsparkError(f"block_size must be >= 2, got {self.block_size}")
        if self.anchors_per_seq != ALL_ANCHORS and (not isinstance(self.anchors_per_seq, int)
                                                    or isinstance(self.anchors_per_seq, bool)):
            raise DsparkError(f"anchors_per_seq must be a number or \"all\", got {self.anchors_per_seq!r}")
        for name in ("steps", "batch_size", "grad_accum", "layers", "checkpoint_every", "eval_every",
                     "ttt_steps", "anchor_chunk") + (("anchors_per_seq",) if self.anchors_per_seq != ALL_ANCHORS else ()):
            if getattr(self, name) < 1:
                raise DsparkError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < 4:
            raise DsparkError(f"max_seq_len must be >= 4, got {self.max_seq_len}")
        if not 0 <= self.warmup_frac < 1 or not 0 <= self.val_fraction < 1:
            raise DsparkError("warmup_frac and val_fraction must be in [0, 1)")
        if self.draft_layer not in ("qwen3", "target"):
            raise DsparkError(f"draft_layer must be qwen3 or target, got {self.draft_layer!r}")
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise DsparkError(f"checkpoint_dtype must be one of {', '.join(CHECKPOINT_DTYPES)}, "
                              f"got {self.checkpoint_dtype!r}")
        if self.autocast not in ("auto", "bf16", "off"):
            raise DsparkError(f"autocast must be auto, bf16 or off, got {self.autocast!r}")
        if self.compile_loss not in ("auto", "on", "off"):
            raise DsparkError(f"compile_loss must be auto, on or off, got {self.compile_loss!r}")
        if self.target_dtype not in TARGET_DTYPES:
            raise DsparkError(f"target_dtype must be one of {', '.join(TARGET_DTYPES)}, got {self.target_dtype!r}")
        if self.device != "auto":
            try:
                kind = torch.device(self.device).type
            except (RuntimeError, ValueError):
                kind = None
            if kind not in ("cpu", "cuda"):
                raise DsparkError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
            if kind == "cuda" and not torch.cuda.is_available():
                raise DsparkError(f"device {self.device!r}: this PyTorch sees no CUDA GPU; set device = \"cpu\"")
        if self.lr <= 0:
            raise DsparkError(f"lr must be > 0, got {self.lr}")
        return self

    @property
    def data_paths(self) -> list[str]:
        return [self.data] if isinstance(self.data, str) and self.data else [p for p in self.data if p]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _coerce(name: str, value: Any) -> Any:
    field = _FIELDS.get(name)
    if field is None:
        raise DsparkError(f"unknown training option {name!r}; known: {', '.join(sorted(_FIELDS))}")
    default = TrainConfig().__getattribute__(name)
    if name == "anchors_per_seq" and value == ALL_ANCHORS:
        return value
    if name == "data":
        return _data_paths(value)
    try:
        if isinstance(value, str) and not isinstance(default, str):
            value = json.loads(value.lower() if isinstance(default, bool) else value)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError
        elif isinstance(default, float):
            value = float(value)
        elif isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            value = int(value)
        elif isinstance(default, list):
            value = [int(v) for v in value]
        elif isinstance(default, str) and not isinstance(value, str):
            raise ValueError
    except (ValueError, TypeError, json.JSONDecodeError):
        raise DsparkError(f"option {name!r}: cannot use {value!r} (expected {type(default).__name__})") from None
    return value


def _data_paths(value: Any) -> str | list[str]:
    """`data`: one path, or a list of them (TOML / YAML list, or a JSON list through --set)."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DsparkError(f"option 'data': cannot parse {value!r} as a JSON list of paths") from None
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise DsparkError(f"option 'data': expected a path or a list of paths, got {value!r}")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    raw: dict[str, Any] = {}
    if path:
        path = Path(path).expanduser()
        if not path.is_file():
            raise DsparkError(f"config file {path} does not exist")
        text = path.read_text()
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                raw = yaml.safe_load(text) or {}
            else:
                raw = tomllib.loads(text)
        except Exception as e:  # both parsers raise their own error types
            raise DsparkError(f"{path}: cannot parse ({e})") from None
        if not isinstance(raw, dict):
            raise DsparkError(f"{path}: expected a table of options")
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):  # a section: [drafter], [train], [loss] ...
            flat.update(value)
        else:
            flat[key] = value
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise DsparkError(f"--set expects key=value, got {item!r}")
        flat[key.strip()] = value.strip()
    cfg = TrainConfig(**{k: _coerce(k, v) for k, v in flat.items()})
    return cfg.validate()
