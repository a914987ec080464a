"""`dspark data regenerate`: the target answers training prompts."""

from __future__ import annotations

import json

from dspark.cli.common import command_group, open_target, positive_int, target_args
from dspark.util.files import check_writable


def add_parsers(sub) -> None:
    dat = command_group(sub, "data", "prepare training data", "Prepare training data.")
    rg = dat.add_parser(
        "regenerate",
        help="let the target answer training prompts (resumable)",
        description="Let the target answer each prompt through its chat template (continuous batching "
        "on the engine). --out is either a .jsonl file, appended with {id, prompt_ids, response_ids, response, "
        "finish_reason} lines, or a directory: a shard store of token ids (sealed safetensors shards of "
        "--shard-size replies plus manifest.json with their sha256; commit the shards and the manifest, "
        "pending.jsonl is local work in progress). Rerunning with the same --out skips prompts already "
        "answered, so an interrupted run resumes; a store refuses replies made with other settings. "
        "Prompt files: JSONL with 'turns', ShareGPT 'conversations' or Alpaca 'instruction'/'input'.",
    )
    rg.add_argument("--prompts", required=True, action="append", help="prompt JSONL file (repeatable)")
    rg.add_argument("--out", required=True, help="output: a .jsonl file, or a directory for a shard store")
    rg.add_argument("--shard-size", type=positive_int, default=1024,
                    help="replies per sealed shard of a store (default 1024)")
    target_args(rg, threads=True)
    rg.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts (after dedup)")
    rg.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                    help="shuffle the prompts with this seed before --limit (a mixed subset of a sorted file)")
    rg.add_argument("--skip-validation-fraction", type=float, default=0.0, metavar="F",
                    help="leave out the prompts the trainer's id-hash split would hold out as validation")
    rg.add_argument("--max-new-tokens", type=positive_int, default=512, help="reply budget (default 512)")
    rg.add_argument("--max-prompt-tokens", type=positive_int, default=1024, help="skip longer prompts (default 1024)")
    rg.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    rg.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95)")
    rg.add_argument("--top-k", type=int, default=0, help="top-k (default 0 = off)")
    rg.add_argument("--batch-size", type=positive_int, default=16, help="rows decoded together (default 16)")
    rg.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    rg.set_defaults(func=cmd_data_regenerate)


def cmd_data_regenerate(args) -> int:
    from dspark.model.loading import parse_dtype
    from dspark.sampling import SamplingParams
    from dspark.train.data import select_prompts
    from dspark.train.regenerate import regenerate

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    parse_dtype(args.dtype)
    check_writable(args.out, "file" if args.out.endswith(".jsonl") else "directory")
    prompts = select_prompts(args.prompts, args.shuffle, args.limit, args.skip_validation_fraction)
    target = open_target(args)
    stats = regenerate(target, prompts, args.out, params, args.max_new_tokens, args.batch_size, args.seed,
                       args.max_prompt_tokens, shard_size=args.shard_size)
    print(json.dumps(stats))
    return 0
