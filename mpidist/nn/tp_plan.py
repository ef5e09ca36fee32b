"""Tensor-parallel plans: which layer of a model is split how, as data.

A plan maps layer-name patterns (:func:`fnmatch.fnmatchcase` on the dotted names of
:meth:`~mpidist.nn.Module.named_modules`, e.g. ``"blocks.*.attn.qkv"``) to a style:

==========================  =========================  ==========================================
style                       applies to                 becomes (:mod:`~mpidist.nn.tensor_parallel`)
==========================  =========================  ==========================================
``"colwise"`` /              a Linear (or Dense)        ColumnParallelLinear: output features split
:class:`ColwiseParallel`
``"rowwise"`` /              a Linear (or Dense)        RowParallelLinear: input features split,
:class:`RowwiseParallel`                                output summed over tp
``"vocab"`` /                an Embedding or LMHead     VocabParallelEmbedding / VocabParallelLMHead
:class:`VocabParallel`
``"heads"`` /                an attention (``n_head``)  the same module running ``n_head / tp``
:class:`HeadParallel`                                  local heads
==========================  =========================  ==========================================

A string is the style with its default options; ``ColwiseParallel(groups=3)`` splits each of
three equal column blocks (the fused q|k|v projection). Layers no pattern matches stay
replicated. :func:`check_plan` validates a plan against a model and a tp size without any
communication; :func:`mpidist.nn.tensor_parallel.parallelize` applies it. Everything here
is pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

from .layers import Embedding, Linear
from .models import GPT, MLP, LMHead
from .module import Module

__all__ = [
    "GPT_PLAN",
    "STYLES",
    "ColwiseParallel",
    "HeadParallel",
    "Plan",
    "RowwiseParallel",
    "Style",
    "VocabParallel",
    "check_plan",
    "default_plan",
    "mlp_plan",
]


def _not_divided(tp: int, what: str, n: int, layer: str) -> str | None:
    return f"tp={tp} does not divide {what}={n} of layer {layer}" if n % tp else None


def _wrong_kind(style: str, wants: str, layer: str, module: Module) -> str:
    return f"style {style!r} applies to {wants}; layer {layer} is a {type(module).__name__}"


@dataclass(frozen=True)
class ColwiseParallel:
    """Split a Linear's output features (``groups`` equal blocks each split, e.g. 3 for
    q|k|v); with ``gather_output`` the output is allgathered, else each rank keeps its slice."""

    groups: int = 1
    gather_output: bool = False

    def problem(self, layer: str, module: Module, tp: int) -> str | None:
        """Why this style cannot split ``module`` over ``tp`` ranks, or None. Pure."""
        if not isinstance(module, Linear):
            return _wrong_kind("colwise", "a Linear", layer, module)
        if self.groups < 1 or module.out_features % self.groups:
            return f"groups={self.groups} does not divide out_features={module.out_features} " \
                   f"of layer {layer}"
        if self.gather_output and self.groups > 1:
            return f"gather_output with groups={self.groups} (layer {layer}) is not supported"
        per = module.out_features // self.groups
        if self.groups > 1 and per % tp:
            return f"tp={tp} does not divide out_features={module.out_features} / " \
                   f"{self.groups} blocks = {per} of layer {layer}"
        return _not_divided(tp, "out_features", module.out_features, layer)


@dataclass(frozen=True)
class RowwiseParallel:
    """Split a Linear's input features and sum the partial outputs over tp; the input is
    this rank's slice (``input_is_parallel``, after a colwise layer) or split here."""

    input_is_parallel: bool = True

    def problem(self, layer: str, module: Module, tp: int) -> str | None:
        """Why this style cannot split ``module`` over ``tp`` ranks, or None. Pure."""
        if not isinstance(module, Linear):
            return _wrong_kind("rowwise", "a Linear", layer, module)
        return _not_divided(tp, "in_features", module.in_features, layer)


@dataclass(frozen=True)
class VocabParallel:
    """Split an Embedding's rows or an LMHead's vocabulary (the logits stay sharded: use
    :class:`~mpidist.nn.tensor_parallel.VocabParallelCrossEntropy`)."""

    def problem(self, layer: str, module: Module, tp: int) -> str | None:
        """Why this style cannot split ``module`` over ``tp`` ranks, or None. Pure."""
        if isinstance(module, Embedding):
            return _not_divided(tp, "vocab_size", module.num_embeddings, layer)
        if isinstance(module, LMHead):
            return _not_divided(tp, "vocab_size", module.vocab_size, layer)
        return _wrong_kind("vocab", "an Embedding or LMHead", layer, module)


@dataclass(frozen=True)
class HeadParallel:
    """Run an attention module on its ``n_head / tp`` local heads (its q|k|v projection
    colwise with ``groups=3``, its output projection rowwise)."""

    def problem(self, layer: str, module: Module, tp: int) -> str | None:
        """Why this style cannot split ``module`` over ``tp`` ranks, or None. Pure."""
        n_head = getattr(module, "n_head", None)
        if not isinstance(n_head, int):
            return _wrong_kind("heads", "an attention module (with n_head)", layer, module)
        return _not_divided(tp, "n_head", n_head, layer)


Style = ColwiseParallel | RowwiseParallel | VocabParallel | HeadParallel
Plan = Mapping[str, str | Style]
STYLES: Mapping[str, Style] = MappingProxyType({
    "colwise": ColwiseParallel(), "rowwise": RowwiseParallel(), "vocab": VocabParallel(),
    "heads": HeadParallel(),
})

#: Megatron's GPT split: vocab-parallel embedding and head, heads split in attention,
#: column → row parallel pairs in attention and MLP; LayerNorms and ``wpe`` replicated.
GPT_PLAN: Mapping[str, Style] = MappingProxyType({
    "embed.wte": VocabParallel(),
    "blocks.*.attn": HeadParallel(),
    "blocks.*.attn.qkv": ColwiseParallel(groups=3),
    "blocks.*.attn.proj": RowwiseParallel(),
    "blocks.*.mlp.fc": ColwiseParallel(),
    "blocks.*.mlp.proj": RowwiseParallel(),
    "final.head": VocabParallel(),
})


def mlp_plan(model: MLP) -> dict[str, Style]:
    """Layers ``2i`` colwise and ``2i+1`` rowwise (the hidden activation of each pair stays
    split; one allreduce per pair); an odd last layer stays replicated. Pure."""
    n = len(model.sizes) - 1
    plan: dict[str, Style] = {}
    for i in range(0, n - 1, 2):
        plan[f"layers.{i}"] = ColwiseParallel()
        plan[f"layers.{i + 1}"] = RowwiseParallel()
    return plan


def default_plan(module: Module) -> dict[str, Style]:
    """The model's plan: its own ``tp_plan()`` if it defines one, :data:`GPT_PLAN` for a GPT,
    :func:`mlp_plan` for an MLP; ValueError naming the type otherwise. Pure."""
    own = getattr(module, "tp_plan", None)
    if callable(own):
        return dict(own())
    if isinstance(module, GPT):
        return dict(GPT_PLAN)
    if isinstance(module, MLP):
        return mlp_plan(module)
    raise ValueError(f"no default tensor-parallel plan for a {type(module).__name__}; "
                     "pass a plan (layer pattern -> 'colwise' | 'rowwise' | 'vocab' | 'heads')")


def _style(pattern: Any, value: Any) -> Style:
    if not isinstance(pattern, str):
        raise ValueError(f"plan pattern {pattern!r} must be a string")
    if isinstance(value, str) and value in STYLES:
        return STYLES[value]
    if isinstance(value, (ColwiseParallel, RowwiseParallel, VocabParallel, HeadParallel)):
        return value
    raise ValueError(f"style {value!r} of plan pattern {pattern!r} is not one of "
                     f"{sorted(STYLES)} or a ColwiseParallel/RowwiseParallel/VocabParallel/"
                     "HeadParallel")


def _tie_problems(module: Module, styles: Mapping[str, Style]) -> list[str]:
    """A parameter shared by two layers (weight tying) must be split alike in both."""
    out = []
    for name, mod in module.named_modules():
        if next(mod.children(), None) is not None:
            continue
        own = set(mod.parameter_names(include_shared=False))
        for tied in mod.parameter_names(include_shared=True):
            owner = tied.rpartition(".")[0]
            if tied not in own and styles.get(name) != styles.get(owner):
                out.append(f"layer {name} is tied to {tied}: both layers need the same style "
                           f"(got {styles.get(name)} and {styles.get(owner)})")
    return out


def check_plan(module: Module, plan: Plan, tp: int) -> dict[str, Style]:
    """Validate ``plan`` for ``module`` split over ``tp`` ranks; return ``{layer name:
    style}`` of the matched layers in tree order.

    Every pattern must match a layer, no layer may match two patterns, each style must fit
    its layers and ``tp`` divide what it splits. All problems are raised as one ValueError
    (one line; for each pattern its first bad layer), e.g. ``"tp=4 does not divide
    out_features=6 of layer blocks.0.mlp.fc"``. Pure: the same answer on every rank, so
    call it before any communication.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    if not isinstance(plan, Mapping):
        raise ValueError(f"a plan maps layer patterns to styles; got a {type(plan).__name__}")
    parsed = {pattern: _style(pattern, value) for pattern, value in plan.items()}
    layers = [(n, m) for n, m in module.named_modules() if m is not module]
    styles: dict[str, Style] = {}
    owner: dict[str, str] = {}
    problems: list[str] = []
    for pattern, style in parsed.items():
        hits = [(n, m) for n, m in layers if fnmatchcase(n, pattern)]
        if not hits:
            problems.append(f"plan pattern {pattern!r} matches no layer of the "
                            f"{type(module).__name__}")
        for name, _ in hits:
            if name in owner:
                raise ValueError(f"layer {name} matches plan patterns {owner[name]!r} and "
                                 f"{pattern!r}")
            owner[name], styles[name] = pattern, style
        bad = [p for p in (style.problem(n, m, tp) for n, m in hits) if p]
        problems += bad[:1]
    problems += _tie_problems(module, styles)
    if problems:
        raise ValueError("; ".join(problems))
    order = {n: i for i, (n, _) in enumerate(layers)}
    return dict(sorted(styles.items(), key=lambda kv: order[kv[0]]))
