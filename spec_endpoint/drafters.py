"""Which drafters this endpoint hosts: target model name -> its draft model and n-gram drafter.

Built once at start-up from repeated `--drafter NAME=TARGET_GGUF[,draft=DIR][,head=DIR][,datastore=NPZ]`
flags (TARGET_GGUF may be a Hugging Face model directory too; draft= a project draft checkpoint, or any GGUF
or Hugging Face model sharing the target's tokenizer). A draft model or head reads the target's
input embeddings from the target's file (the checkpoint omits them) and gets a fixed number of KV slots;
the draft model's measured step costs are published to targets, whose speculation policy charges drafting
time with them. A head (EAGLE style) reads the target's features too, which its sessions send with every
round; SSD pre-speculates with the head where there is one (its forks grow from the head's predicted
features), else with the draft model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specpool.common import model_args
from specpool.engine.drafters import registry
from specpool.engine.drafters.base import Drafter, Prespeculating
from specpool.engine.drafters.lookup import SuffixArrayDatastore
from specpool.engine.drafters.registry import DraftSources
from specpool.engine.drafters.suffix_store import SuffixStore, SuffixStores
from specpool.engine.method import Method
from specpool.engine.plan import TreeShape
from specpool.engine.policy.costs import StepCosts, cached_step_costs
from specpool.engine.runtime.draft_pair import TargetMismatch, VocabularyMismatch, is_model_file, load_draft
from specpool.engine.runtime.gguf_loader import GGUFModel, default_model_path, model_name
from specpool.engine.runtime.hf_loader import HFModel, load_model_file
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import make_generator

if TYPE_CHECKING:
    from specpool.engine.drafters.ngram import NgramDrafter

log = logging.getLogger(__name__)

DEFAULT_DRAFT_DIR = Path(model_args.DEFAULT_DRAFT_DIR)
DEFAULT_HEAD_DIR = Path(model_args.DEFAULT_HEAD_DIR)
DEFAULT_DATASTORE = Path(model_args.DEFAULT_DATASTORE)
# The trees tree sessions get (--tree-shape): where the draft is unsure it branches 4 ways, 4 nodes a
# level, 8 deep.
TREE_SHAPE = TreeShape(branch=4, beam=4, max_depth=8)
_REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    """One `--drafter` flag: the wire name of a target model and where its drafters come from."""

    name: str
    target_gguf: Path
    draft_dir: Path | None = None
    datastore: Path | None = None
    head_dir: Path | None = None

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        """`NAME=TARGET_GGUF[,draft=DIR][,head=DIR][,datastore=NPZ]`; NAME may be left out (`TARGET_GGUF,...`):
        the name is then the GGUF file name without .gguf (a directory's name), as targets report it. `default`
        alone is the default model's (DrafterSpec.default), so a list of several can name it beside others."""
        if text == "default":
            return cls.default()
        head, *options = text.split(",")
        name, sep, gguf = head.partition("=")
        if not sep:
            name, gguf = "", head
        if not gguf:
            raise ValueError(f"--drafter {text!r}: expected NAME=TARGET_GGUF[,draft=DIR][,head=DIR][,datastore=NPZ]")
        extra: dict[str, Path] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("draft", "head", "datastore") or not value:
                raise ValueError(f"--drafter {text!r}: unknown option {option!r} (draft=DIR, head=DIR, datastore=NPZ)")
            extra[key] = Path(value)
        return cls(
            name=name or model_name(gguf),
            target_gguf=Path(gguf),
            draft_dir=extra.get("draft"),
            datastore=extra.get("datastore"),
            head_dir=extra.get("head"),
        )

    @classmethod
    def default(cls) -> DrafterSpec:
        """The default target with the project's own draft model, head and datastore (paths relative to
        the current directory, else to this source checkout)."""
        gguf = default_model_path()
        return cls(model_name(gguf), gguf, _existing(DEFAULT_DRAFT_DIR), _existing(DEFAULT_DATASTORE),
                   _existing(DEFAULT_HEAD_DIR))


def _existing(relative: Path) -> Path:
    if relative.exists() or not (_REPO_ROOT / relative).exists():
        return relative
    return _REPO_ROOT / relative


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How every hosted model's drafters are built (the serve-spec flags)."""

    max_sessions: int
    max_len: int
    device: torch.device
    step_cost_dir: Path | None = None
    ssd: dict | None = None  # SsdDrafter options
    dtype: str = "auto"  # engine/runtime/device.py draft_format
    tree_shape: TreeShape = TREE_SHAPE
    suffix_tokens: int = 50_000  # per tenant's suffix store (0: none)
    suffix_stores: int = 16  # stores per model: the least recently used tenant's is dropped beyond
    suffix_shared: frozenset[str] = frozenset()  # tenants that opted in to one store shared between them


@dataclass(slots=True)
class ModelDrafters:
    """The drafters of one target model, by method (built by the engine's drafter registry)."""

    name: str
    vocab_size: int
    drafters: dict[Method, Drafter]
    max_len: int = 2048  # tokens a session may hold (context and reported tokens), every drafter kind
    feature_dim: int = 0  # the width of the target's features, which a head reads
    draft_costs: StepCosts | None = None
    tree_shape: TreeShape = TREE_SHAPE
    suffix: SuffixStores | None = None  # n-gram sessions' online suffix stores, by tenant
    suffix_shared: frozenset[str] = frozenset()
    generator: torch.Generator | None = field(default=None, repr=False)  # samples the draft model
    models: tuple[Llama, ...] = field(default=(), repr=False)  # the draft model and head its drafters run
    # Those of the drafters that pre-speculate: told once here, for the batcher and pre-speculation.
    prespeculating: dict[Method, Prespeculating] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prespeculating = {kind: d for kind, d in self.drafters.items() if d.caps.prespeculates}

    @property
    def kinds(self) -> tuple[Method, ...]:
        """What sessions may ask for; the first is what they get when they name none."""
        return tuple(self.drafters)

    @property
    def best(self) -> Method:
        return self.kinds[0]

    @property
    def ngram(self) -> NgramDrafter | None:
        """The n-gram drafter, whose request indexes the endpoint builds outside its lock."""
        return self.drafters.get(Method.NGRAM)

    def suffix_store(self, tenant: str) -> SuffixStore | None:
        """The tenant's suffix store: its own, or the one the opted-in tenants share (never another's)."""
        if self.suffix is None:
            return None
        return self.suffix.for_tenant(self.name, tenant, share=tenant in self.suffix_shared)

    def drafter(self, kind: Method) -> Drafter:
        if kind not in self.drafters:
            raise KeyError(f"{self.name} has no {kind.value} drafter")
        return self.drafters[kind]

    @classmethod
    def load(cls, spec: DrafterSpec, options: LoadOptions) -> ModelDrafters:
        max_len, device = options.max_len, options.device
        target = load_model_file(spec.target_gguf, only={"embed"})  # a GGUF or a HF directory
        vocab = target.config.vocab_size
        datastore = SuffixArrayDatastore.load(spec.datastore) if spec.datastore else None
        models = {kind: _load_draft(spec, kind, path, target, options)
                  for kind, path in (("draft", spec.draft_dir), ("head", spec.head_dir)) if path is not None}
        for model in models.values():
            if max_len > model.config.max_context:
                # No session may outgrow a draft's positions (the n-gram drafter's too: one cap per model).
                log.warning("--drafter %s: --max-len %d exceeds a draft's context %d; sessions are capped at %d",
                            spec.name, max_len, model.config.max_context, model.config.max_context)
                max_len = model.config.max_context
        sources = DraftSources(options.max_sessions, max_len, draft=models.get("draft"), head=models.get("head"),
                               datastore=datastore, tree_shape=options.tree_shape, ssd=options.ssd or {})
        drafters = cls(name=spec.name, vocab_size=vocab, drafters=registry.build_all(sources), max_len=max_len,
                       feature_dim=target.config.d_model, tree_shape=options.tree_shape,
                       suffix_shared=options.suffix_shared,
                       suffix=SuffixStores(options.suffix_tokens, options.suffix_stores) if options.suffix_tokens else None,
                       models=tuple(models.values()))
        if "draft" in models:
            drafters.draft_costs = cached_step_costs(models["draft"], str(spec.draft_dir),
                                                     cache_dir=options.step_cost_dir)
        if models:
            drafters.generator = make_generator(None, device)
        log.info(
            "drafters for %s: %s (vocab %d%s)", spec.name, ", ".join(k.value for k in drafters.kinds), vocab,
            f", datastore {len(datastore)} tokens" if datastore else "",
        )
        return drafters


def _load_draft(spec: DrafterSpec, kind: str, path: Path, target: GGUFModel | HFModel,
                options: LoadOptions) -> Llama:
    """A draft model or head checkpoint, with the target's embeddings: one trained for another target is refused.
    A draft model may also be a model file of its own (a GGUF, a Hugging Face directory) sharing the target's
    tokenizer (engine/runtime/draft_pair.py): a pair whose vocabularies differ is refused here, at start."""
    if kind == "draft" and is_model_file(path):
        try:
            return load_draft(path, spec.target_gguf, target.config.vocab_size, options.dtype, str(options.device))
        except VocabularyMismatch as e:
            raise ValueError(f"--drafter {spec.name}: {e}") from e
    try:
        model = Llama.from_draft_checkpoint(path, target.weights["embed"], dtype=options.dtype,
                                            device=str(options.device), target=spec.target_gguf)
    except TargetMismatch as e:
        raise ValueError(f"--drafter {spec.name}: {kind} {e}") from e
    if kind == "head" and not model.config.feature_fed:
        raise ValueError(f"--drafter {spec.name}: head={path} is not a draft head (train one with "
                         "`specpool train-draft --kind head`); pass a draft model as draft=DIR")
    return model


class HostedDrafters:
    """Target model name -> ModelDrafters."""

    def __init__(self, models: dict[str, ModelDrafters]):
        self.models = models

    @classmethod
    def load(cls, specs: list[DrafterSpec], options: LoadOptions) -> HostedDrafters:
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"--drafter: model {duplicates[0]!r} given more than once")
        return cls({s.name: ModelDrafters.load(s, options) for s in specs})

    def forwards(self) -> dict[str, int]:
        """Target model name -> forwards its draft model and head have run so far (every propose and
        pre-speculation step, whatever the batch: what batching across targets saves)."""
        return {name: sum(m.forwards for m in d.models) for name, d in self.models.items()}

    def get(self, name: str) -> ModelDrafters | None:
        return self.models.get(name)

    def names(self) -> list[str]:
        return sorted(self.models)
