"""The `specpool` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import shlex
import sys
from collections.abc import Collection

from specpool.common.model_args import (
    DEFAULT_DATASTORE,
    DEFAULT_DRAFT_DIR,
    DEFAULT_HEAD_DIR,
    add_model_args,
    model_arg,
)

# Servers and cluster tools: subcommand -> (module bringing add_arguments(parser) and main(args), help).
# Nothing heavy is imported to build the parser: a subcommand's modules (torch, the servers) load only
# when that subcommand runs or shows its help, so `specpool --help` answers at once.
TOOLS = {
    "serve-target": ("specpool.target_service.server", "serve one target model over gRPC (Target API)"),
    "serve-spec": ("specpool.spec_endpoint.server", "serve the pooled speculation endpoint over gRPC"),
    "serve-router": ("specpool.router.server", "route Target API requests to target replicas and draft slots"),
    "plan": ("specpool.cluster.plan", "size the speculation pool for a demand mix from measured statistics"),
    "up": ("specpool.cluster.up", "start a local cluster (default: Redis, a router, two targets, one endpoint)"),
    "demo": ("specpool.cluster.demo", "the local cluster, a short workload through its router: speedup vs AR"),
    "scale": ("specpool.cluster.scale", "add or drain a tenant's target replicas of a Ray-launched cluster"),
    "down": ("specpool.cluster.down", "stop a Ray-launched cluster (specpool up --ray): drain, then remove it"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where its help already states it or there is none worth
    printing: None (the help says what unset means), a switch's False, an empty string or list."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        if "default" in help_text or default is None or default is False or default in ("", []):
            return help_text
        return super()._get_help_string(action)


def version() -> str:
    try:
        return importlib.metadata.version("specpool")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def load_model(args: argparse.Namespace):
    from specpool.engine.runtime.gguf_loader import default_model_path
    from specpool.engine.runtime.model import Llama

    _set_threads(args.threads)
    return Llama.from_path(args.model or default_model_path(), dtype=args.dtype, device=args.device)


def cmd_generate(args: argparse.Namespace) -> int:
    from specpool.engine.decoding import generate
    from specpool.engine.verification.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed)
    params.validate()
    model, tokenizer = load_model(args)
    if args.chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode_prompt(args.prompt)
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

    from specpool.engine.runtime.gguf_loader import default_model_path, model_name

    _set_threads(args.threads)
    kind = {"model": "draft", "head": "head"}[args.kind]
    # Another target's checkpoint and data go beside the default's, never over them.
    name = "smollm2-135m" if args.model is None else model_name(args.model).lower()
    common = {
        "target": Path(args.model) if args.model else default_model_path(),
        "out": Path(args.out or f"models/{name}-{kind}"),
        "work_dir": Path(args.work_dir or f".cache/train-{kind}" + ("" if args.model is None else f"-{name}")),
        "data_minutes": args.data_minutes,
        "train_minutes": args.train_minutes,
        "draft_vocab": args.draft_vocab,
    } | ({"dtype": args.dtype} if args.dtype else {})
    if args.kind == "head":
        from specpool.training.train_head import TrainHeadConfig, run

        run(TrainHeadConfig(**common))
    else:
        from specpool.training.train_draft import TrainDraftConfig, run

        run(TrainDraftConfig(**common, layers=args.layers))
    return 0


BENCH_COMPANIONS = {"draft": DEFAULT_DRAFT_DIR, "head": DEFAULT_HEAD_DIR, "datastore": DEFAULT_DATASTORE}


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specpool.bench.modes import BenchConfig
    from specpool.bench.runner import print_table, run_bench, write_report
    from specpool.engine.runtime.gguf_loader import default_model_path

    _set_threads(args.threads)
    # The shipped draft, head and datastore are SmolLM2's: another target gets only what is named.
    for name, path in BENCH_COMPANIONS.items():
        if getattr(args, name) is None and not args.model:
            setattr(args, name, path)
    cfg = BenchConfig(
        model_path=Path(args.model) if args.model else default_model_path(),
        workload=args.workload,
        limit=args.limit,
        max_tokens=args.max_tokens,
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        temperature=args.temperature,
        modes=args.modes.split(","),
        draft_dir=Path(args.draft) if args.draft else None,
        head_dir=Path(args.head) if args.head else None,
        datastore=Path(args.datastore) if args.datastore else None,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        seed=args.seed,
        spec_delay_ms=args.spec_delay_ms,
        threads=args.threads,
        cluster_config=Path(args.cluster) if args.cluster else None,
        ray_address=None if args.ray in (None, "local") else args.ray,
        endpoint_args=tuple(shlex.split(args.endpoint_args)),
        target_args=tuple(shlex.split(args.target_args)),
    )
    report = run_bench(cfg)
    print_table(report)
    write_report(report, Path(args.json) if args.json else None, "specpool " + " ".join(sys.argv[1:]))
    return 0


def cmd_build_datastore(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specpool.engine.drafters.lookup import SuffixArrayDatastore
    from specpool.training.draft_data import Corpus

    corpus = Corpus.load(Path(args.corpus))
    # Only what the model wrote: the answers, not the prompts they answered.
    answers = [seq[n:] for seq, n in zip(corpus.sequences, corpus.prompt_lens)]
    store = SuffixArrayDatastore.build(answers)
    store.save(Path(args.out))
    print(f"datastore: {len(answers)} answers, {len(store)} tokens -> {args.out}")
    return 0


def build_parser(tools: Collection[str] = tuple(TOOLS)) -> argparse.ArgumentParser:
    """Every subcommand, with the flags of the TOOLS named in tools: a tool's flags come from its module,
    so naming it imports it. The others are listed, without flags."""
    parser = argparse.ArgumentParser(prog="specpool", description=__doc__, formatter_class=HelpFormatter,
                                     epilog="`specpool COMMAND --help` lists a command's flags and their defaults.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    def add_command(name: str, help_text: str) -> argparse.ArgumentParser:
        # Subparsers take neither the parent's formatter nor its help as their description.
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)

    g = add_command("generate", "run a model in-process on one prompt")
    g.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user's message)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template (with its system prompt)")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens to generate, at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the most likely tokens up to this total probability (1: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep the tokens at least this share as likely as the most likely one (0: all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (unset: a fresh random one)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(g)
    g.set_defaults(func=cmd_generate)

    b = add_command("bench", "measure every mode on a workload, side by side in one run")
    b.add_argument("--workload", default="humaneval", help="humaneval, chat (bench/chat.jsonl) or a .jsonl file (prompt or messages)")
    b.add_argument("--limit", type=int, default=None, help="first N prompts (unset: all)")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt, at most")
    b.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes, each measured in turn")
    b.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    b.add_argument("--seed", type=int, default=0, help="sampling seed (the n-th batch of prompts uses seed + n)")
    b.add_argument("--modes", default="ar,sd,ngram,hf-ar,hf-prompt-lookup,hf-assisted",
                   help="ar, ar-fp32 (AR on the fp32 reference format), sd[:K], ngram[:K], head[:K] (the feature-fed head), sd-tree[:N] and head-tree[:N] "
                        "(token trees of N nodes; none: the policy's budget), head-suffix[:N] (the suffix store's trees "
                        "where it is sure, else the head's), sd-remote[:K], head-remote[:K], head-tree-remote[:N], "
                        "ngram-remote, ssd, ssd-pull, routed, routed-ar, routed-http (routed through the router's "
                        "OpenAI-compatible HTTP front), routed-ray, routed-ray-ar (the cluster's members as Ray "
                        "actors), hf-ar, hf-prompt-lookup, hf-assisted (transformers), llamacpp-ar, llamacpp-lookup[:K] "
                        "(llama.cpp: make bench-deps), llamacpp-sd[:N] (llama.cpp's own speculation, drafting up to N "
                        "tokens, default 4, with --draft's GGUF; batch 1, greedy; builds llama-speculative-simple "
                        "once, about 4 minutes)")
    b.add_argument("--spec-delay-ms", type=float, default=0.0,
                   help="remote modes: delay injected into every speculation message, each way")
    b.add_argument("--endpoint-args", default="",
                   help="remote modes: further serve-spec flags, one string (e.g. '--ssd-fork-budget 16')")
    b.add_argument("--target-args", default="",
                   help="remote modes: further serve-target flags, one string (e.g. '--spec-deadline-ms 2000')")
    b.add_argument("--cluster", default=None,
                   help="routed modes: cluster config whose targets all serve the bench's model (default: "
                        "cluster/examples/smollm2.yaml)")
    b.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="routed-ray modes: the Ray cluster to launch the cluster file on (unset or alone: a one-node "
                        "Ray on 127.0.0.1 for the run)")
    b.add_argument("--draft", default=None, type=model_arg,
                   help="the draft model: a checkpoint directory (train-draft's), or a model file sharing the "
                        "target's tokenizer (a GGUF, a Hugging Face directory, a short name: qwen2.5-coder-0.5b); "
                        f"default with the default model: {BENCH_COMPANIONS['draft']}, with another: none")
    b.add_argument("--head", default=None, help="feature-fed head checkpoint directory (default with the default "
                                                "model: " + BENCH_COMPANIONS["head"] + ", with another: none)")
    b.add_argument("--draft-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="the draft model's and the head's weights (auto: Q8_0 blocks through the engine's CPU "
                        "kernels where they build, else bf16 where native, else fp32)")
    b.add_argument("--datastore", default=None,
                   help="n-gram datastore (empty string: per-request index only; default with the default model: "
                        + BENCH_COMPANIONS["datastore"] + ", with another: none)")
    b.add_argument("--json", default=None, help="write the report here")
    add_model_args(b)
    b.set_defaults(func=cmd_bench)

    d = add_command("build-datastore", "suffix-array datastore of model-generated text for n-gram drafting")
    d.add_argument("--corpus", default=".cache/train-draft/corpus.pt", help="a corpus written by train-draft")
    d.add_argument("--out", default=DEFAULT_DATASTORE, help="where the datastore goes")
    d.set_defaults(func=cmd_build_datastore)

    t = add_command("train-draft", "distil a draft model or a feature-fed head from the target (resumable)")
    t.add_argument("--kind", default="model", choices=["model", "head"],
                   help="model: a small Llama draft; head: a one-layer head fed by the target's features")
    t.add_argument("--out", default=None, help="where the checkpoint and card go (default: models/NAME-draft "
                                               "or models/NAME-head, NAME the target's, smollm2-135m by default)")
    t.add_argument("--work-dir", default=None, help="data and training state, for resuming (default: "
                                                    ".cache/train-draft or .cache/train-head, with -NAME "
                                                    "for a --model)")
    t.add_argument("--data-minutes", type=float, default=14.0,
                   help="budget for the target's answers (a head's features come with them; a model's teacher "
                        "top-k takes a pass of its own)")
    t.add_argument("--train-minutes", type=float, default=30.0, help="training budget (total, across resumes)")
    t.add_argument("--layers", type=int, default=4, help="a model draft's layers, copied from the target's first")
    t.add_argument("--draft-vocab", type=int, default=8192,
                   help="tokens the draft predicts: the corpus's most frequent, mapped back to full ids")
    t.add_argument("--model", type=model_arg, default=None,
                   help="target: a GGUF or a Hugging Face directory of a supported family, or a short name "
                        "(as generate's --model) (default: SmolLM2-135M-Instruct)")
    t.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    t.add_argument("--dtype", default=None, choices=["auto", "fp32", "bf16", "q4"],
                   help="the target's weights in the data pass (default: bf16 for a model, where the CPU "
                        "computes it natively, else fp32; auto for a head, whose features must carry the "
                        "serving format's numerics)")
    t.set_defaults(func=cmd_train_draft)

    for name, (module_name, help_text) in TOOLS.items():
        cmd = add_command(name, help_text)
        if name in tools:
            module = importlib.import_module(module_name)
            module.add_arguments(cmd)
            cmd.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The top-level parser takes no option but --help and --version, so the first word that is not an
    # option is the subcommand: only that tool's module is imported.
    command = next((word for word in argv if not word.startswith("-")), None)
    args = build_parser(tools=[command] if command in TOOLS else []).parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specpool {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
