"""The `specpool` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Llama-architecture GGUF (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="weight/activation dtype (auto: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")


def load_model(args: argparse.Namespace):
    from engine.gguf_loader import default_model_path
    from engine.model import Llama

    if args.threads:
        torch.set_num_threads(args.threads)
    return Llama.from_gguf(args.model or default_model_path(), dtype=args.dtype, device=args.device)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.decoding import generate
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    params.validate()
    model, tokenizer = load_model(args)
    if args.chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise SystemExit("--prompt is empty after tokenization")
    [result] = generate(model, [prompt_ids], params, args.max_tokens)
    text = tokenizer.decode(result.token_ids)
    if args.json:
        print(json.dumps({
            "text": text,
            "prompt_token_ids": result.prompt_ids,
            "token_ids": result.token_ids,
            "tokens_per_s": round(result.tokens_per_s, 3),
        }))
    else:
        print(text)
        print(f"[{len(result.token_ids)} tokens, {result.tokens_per_s:.1f} tokens/s, "
              f"finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.gguf_loader import default_model_path
    from training.train_draft import TrainDraftConfig, run

    if args.threads:
        torch.set_num_threads(args.threads)
    run(TrainDraftConfig(
        target=Path(args.model) if args.model else default_model_path(),
        out=Path(args.out),
        work_dir=Path(args.work_dir),
        data_minutes=args.data_minutes,
        train_minutes=args.train_minutes,
        layers=args.layers,
        draft_vocab=args.draft_vocab,
    ))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="run a model in-process on one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template (with its system prompt)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("train-draft", help="distil a draft model from the target (resumable)")
    t.add_argument("--out", default="models/smollm2-135m-draft", help="where the checkpoint and card go")
    t.add_argument("--work-dir", default=".cache/train-draft", help="corpus and training state, for resuming")
    t.add_argument("--data-minutes", type=float, default=14.0, help="budget for the target's answers + teacher pass")
    t.add_argument("--train-minutes", type=float, default=30.0, help="distillation budget (total, across resumes)")
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--draft-vocab", type=int, default=8192)
    t.add_argument("--model", default=None, help="target GGUF (default: SmolLM2-135M-Instruct)")
    t.add_argument("--threads", type=int, default=None)
    t.set_defaults(func=cmd_train_draft)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specpool {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
