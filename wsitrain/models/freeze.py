"""``model.freeze``: fine-tuning with the early layers fixed, by module path.

Three ways to say what is frozen: ``until`` (every layer from the input up to and including that module), a list
of ``modules``, or (patch encoders) ``last_blocks: N``: only the encoder's last N blocks (wsitrain.patch.blocks) and
what follows them train, the stem (patch and position embeddings, class token) and the earlier blocks are frozen;
``last_blocks: 0`` freezes the whole encoder (the head alone trains). A name is a module path of the built model
(``features.layer2``), a path inside its trunk (``layer2``, short for ``features.layer2``) or inside a patch model's
encoder (``blocks.9``, short for ``features.encoder.blocks.9``); an unknown name is an input error listing the names
there are. ``until`` a module inside a patch encoder also freezes the parameters the encoder holds itself (a ViT's
class token and position embedding: they enter at its input).

Frozen parameters get ``requires_grad=False``: the optimizer never sees them, and the SFT engine plans and runs the
segments that hold only frozen layers (before any trainable one) forward-only, with no recompute, no backward and
nothing saved. BatchNorm layers inside frozen modules normalize with their running statistics (eval mode) whatever
``model.freeze_bn`` says: a frozen stage is the pretrained feature extractor, so its statistics stay pretrained too.

Torch is not imported at module level: config validation imports ``FreezeSpec``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wsitrain.errors import WsiTrainError

if TYPE_CHECKING:
    from torch import nn

TRUNK = "features"  # the trunk's name in every wsitrain model (wsitrain.models.zoo); short names are inside it
ENCODER = f"{TRUNK}.encoder"  # a patch model's encoder (wsitrain.patch.trunk.PatchTrunk); short names inside it too


@dataclass(frozen=True)
class FreezeSpec:
    """What ``model.freeze`` asks for: everything up to ``until`` (inclusive), and/or the listed ``modules``."""

    until: str | None = None
    modules: tuple[str, ...] = ()
    last_blocks: int | None = None  # patch encoders: train only the last N blocks (and what follows)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> FreezeSpec | None:
        """From a config's (or checkpoint's saved config's) ``model.freeze`` section; None when nothing is frozen."""
        if not d:
            return None
        return cls(d.get("until"), tuple(d.get("modules") or ()), d.get("last_blocks"))

    def describe(self) -> str:
        parts = ([f"until {self.until}"] if self.until else []) + ([", ".join(self.modules)] if self.modules else [])
        parts += [f"all but the encoder's last {self.last_blocks} blocks"] if self.last_blocks is not None else []
        return "; ".join(parts)


@dataclass(frozen=True)
class Frozen:
    """What ``apply_freeze`` froze: the module paths (outermost only) and every parameter name."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...]
    n_frozen: int  # parameter elements frozen
    n_trainable: int  # parameter elements still trained

    def describe(self) -> str:
        total = self.n_frozen + self.n_trainable
        return (f"frozen {', '.join(self.modules)} ({self.n_frozen:,} of {total:,} parameters; forward-only, "
                "BatchNorm in eval mode)")  # fmt: skip


def module_names(model: nn.Module) -> list[str]:
    """The names ``model.freeze`` accepts, outermost first: the model's parts and the trunk's parts (short form)."""
    from torch import nn

    top = [n for n, _ in model.named_children()]
    trunk = getattr(model, TRUNK, None)
    inner = [n for n, _ in trunk.named_children()] if trunk is not None else []
    encoder = getattr(trunk, "encoder", None)
    if isinstance(encoder, nn.Module):  # a patch model: the encoder's parts, and its blocks by path
        from wsitrain.patch.blocks import block_paths

        inner += [n for n, _ in encoder.named_children()] + list(block_paths(encoder))
    return top + list(dict.fromkeys(inner))


def resolve_module(model: nn.Module, name: str, key: str) -> str:
    """The full module path ``name`` means (``layer2`` -> ``features.layer2``); an input error when there is none."""
    paths = {n for n, _ in model.named_modules() if n}
    for candidate in (name, f"{TRUNK}.{name}", f"{ENCODER}.{name}"):
        if candidate in paths:
            return candidate
    names = module_names(model)
    close = difflib.get_close_matches(name, names + sorted(paths), n=3)
    maybe = f"; did you mean {' or '.join(close)}?" if close else ""
    raise WsiTrainError(
        f"{key}: {getattr(model, 'name', 'the model')} has no module {name!r}{maybe}",
        hint=f"name one of: {', '.join(names)} (or a dotted path inside one of them, e.g. {TRUNK}.{names[-1]})",
    )


def _covered(paths: list[str], root: str) -> list[str]:
    return [p for p in paths if p == root or p.startswith(root + ".")]


def _before_last_blocks(model: nn.Module, n: int, paths: list[str]) -> list[str]:
    """Module paths of a patch encoder before its last ``n`` blocks (all of the encoder for n = 0); input errors when
    the model has no patch encoder or fewer blocks."""
    from wsitrain.patch.blocks import model_blocks, patch_encoder

    if patch_encoder(model) is None:
        raise WsiTrainError(
            f"model.freeze.last_blocks applies to patch encoders; {getattr(model, 'name', 'the model')} is a "
            "whole-slide trunk",
            hint=f"use model.freeze.until with a trunk module instead, e.g. until: {module_names(model)[-1]}",
        )
    blocks = model_blocks(model)
    if n > len(blocks):
        listed = f" ({blocks[0]} ... {blocks[-1]})" if blocks else ""
        raise WsiTrainError(
            f"model.freeze.last_blocks: {n}, but {getattr(model, 'name', 'the encoder')} has {len(blocks)} "
            f"blocks{listed}",
            hint=f"choose 0 to {len(blocks)}",
        )
    if n == 0:  # the whole encoder
        return _covered(paths, ENCODER)
    first = blocks[len(blocks) - n]
    start = paths.index(first)
    return [p for p in _covered(paths, ENCODER) if paths.index(p) < start and not first.startswith(p + ".")]


def frozen_paths(model: nn.Module, spec: FreezeSpec) -> list[str]:
    """Every module path (descendants included) that ``spec`` freezes, in the model's order."""
    paths = [n for n, _ in model.named_modules() if n]
    chosen: set[str] = set()
    if spec.last_blocks is not None:
        chosen |= set(_before_last_blocks(model, spec.last_blocks, paths))
    if spec.until is not None:
        target = resolve_module(model, spec.until, "model.freeze.until")
        end = max(i for i, p in enumerate(paths) if p == target or p.startswith(target + "."))
        # everything before the target's last descendant, except the target's ancestors (they hold later layers too)
        chosen |= {p for p in paths[: end + 1] if not target.startswith(p + ".")}
    for name in spec.modules:
        chosen |= set(_covered(paths, resolve_module(model, name, "model.freeze.modules")))
    return [p for p in paths if p in chosen]


def _encoder_input_owners(model: nn.Module, spec: FreezeSpec) -> list[str]:
    """The patch encoder and its modules above the frozen boundary (``until``'s target, or the first block
    ``last_blocks`` trains) that hold parameters of their own: a ViT's class token and position embedding (timm's on
    the encoder, torchvision's on its ``encoder``) enter at the input, so they freeze with the first blocks."""
    paths = {n for n, _ in model.named_modules()}
    if ENCODER not in paths:
        return []
    boundary = None
    if spec.last_blocks:
        from wsitrain.patch.blocks import model_blocks

        blocks = model_blocks(model)
        boundary = blocks[len(blocks) - spec.last_blocks] if spec.last_blocks <= len(blocks) else None
    elif spec.until is not None:
        boundary = resolve_module(model, spec.until, "model.freeze.until")
    if boundary is None or not boundary.startswith(ENCODER + "."):
        return []
    parts = boundary.split(".")
    return [".".join(parts[:i]) for i in range(ENCODER.count(".") + 1, len(parts))]


def apply_freeze(model: nn.Module, spec: FreezeSpec | None) -> Frozen | None:
    """Freeze what ``spec`` names in place: ``requires_grad=False`` and BatchNorm in eval mode. None: nothing asked.

    Raises WsiTrainError (exit 2) for an unknown module, a choice that freezes no parameter, or one that leaves
    nothing to train. Sets ``model.frozen`` (the returned ``Frozen``) so every later reader sees the same answer.
    """
    from torch import nn

    from wsitrain.models.frozen_bn import freeze_batchnorm

    if spec is None or (spec.until is None and not spec.modules and spec.last_blocks is None):
        model.frozen = None
        return None
    paths = frozen_paths(model, spec)
    mods = dict(model.named_modules())
    frozen_params: list[str] = []
    seen: set[int] = set()
    # a patch encoder's own parameters (a ViT's class token, position embedding) enter at its input: frozen with it,
    # the encoder itself not listed as frozen (its later blocks train)
    own = [q for q in _encoder_input_owners(model, spec) if q not in paths]
    for p in own + paths:
        for pname, param in mods[p].named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                param.requires_grad_(False)
                frozen_params.append(f"{p}.{pname}")
        if isinstance(mods[p], nn.BatchNorm2d):
            freeze_batchnorm(mods[p])
    n_frozen = sum(prm.numel() for prm in model.parameters() if not prm.requires_grad)
    n_trainable = sum(prm.numel() for prm in model.parameters() if prm.requires_grad)
    what = spec.describe()
    if not frozen_params:
        raise WsiTrainError(
            f"model.freeze ({what}) freezes no parameter: those modules have none",
            hint=f"name a module with weights, e.g. until: {module_names(model)[-1]}",
        )
    if n_trainable == 0:
        raise WsiTrainError(
            f"model.freeze ({what}) freezes every parameter: nothing would be trained",
            hint="leave the head (pool/attention/classifier) trainable: freeze up to a trunk stage, e.g. until: layer2",
        )
    outer = [p for p in paths if not any(p.startswith(q + ".") for q in paths)]
    model.frozen = Frozen(tuple(outer), tuple(frozen_params), n_frozen, n_trainable)
    return model.frozen


def head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Module paths of the head: everything after the trunk (attention, pool, classifier), for ``backbone_lr_scale``."""
    names = [n for n, _ in model.named_children()]
    if TRUNK not in names:
        return ()
    return tuple(names[names.index(TRUNK) + 1 :])
