"""The flags of every command that loads a target model: `specpool generate`, `bench` and `serve-target`; and
serve-spec's `--drafter`, whose target and draft model may be short names too (as may a cluster file's)."""

from __future__ import annotations

import argparse

from specpool.engine.runtime.chunked_models import MODELS, ModelNotAssembled, model_path

# What the project ships for the default model (SmolLM2-135M-Instruct): its draft, head and n-gram datastore.
DEFAULT_DRAFT_DIR = "models/smollm2-135m-draft"
DEFAULT_HEAD_DIR = "models/smollm2-135m-head"
DEFAULT_DATASTORE = "models/smollm2-135m-datastore.npz"

MODEL_HELP = ("a GGUF file or a Hugging Face directory of a Llama, Mistral, Qwen2 or Qwen3 model, or the short "
              f"name of one `make setup` assembles ({', '.join(MODELS)}) (default: SmolLM2-135M-Instruct)")
DTYPE_HELP = ("weight format (auto, the default: q4 on CPU where the GGUF is 4-bit, bf16 on a GPU with native "
              "bf16, else fp32; q4: the GGUF's 4-bit blocks through the engine's CPU kernels; bf16: where the "
              "device computes it natively, else fp32; fp32: the reference numerics)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device and --threads."""
    p.add_argument("--model", type=model_arg, default=None, help=MODEL_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "q4"], help=DTYPE_HELP)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")


def model_arg(text: str) -> str:
    """--model's value as a path: a short name (engine/runtime/chunked_models.py) becomes its assembled file."""
    try:
        return model_path(text)
    except ModelNotAssembled as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def drafter_models(text: str) -> str:
    """A `--drafter` value, `[NAME=]TARGET[,draft=PATH][,head=DIR][,datastore=NPZ]`, with its target's and its
    draft's short names resolved to their assembled files (model_path); everything else as given, for
    DrafterSpec.parse to check. Resolved before the target's name is taken from its file name, so a short
    name hosts drafters under the name its targets report. Raises ModelNotAssembled as model_path does."""
    head, *options = text.split(",")
    name, sep, target = head.partition("=")
    head = f"{name}={model_path(target)}" if sep else model_path(head)
    return ",".join([head, *(f"draft={model_path(o.removeprefix('draft='))}" if o.startswith("draft=") else o
                             for o in options)])


def drafter_arg(text: str) -> str:
    """--drafter's value with its short names resolved (drafter_models)."""
    try:
        return drafter_models(text)
    except ModelNotAssembled as e:
        raise argparse.ArgumentTypeError(str(e)) from e
