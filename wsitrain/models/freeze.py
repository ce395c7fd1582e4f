"""``model.freeze``: fine-tuning with the early layers fixed, by module path.

Two ways to say what is frozen: ``until`` (every layer from the input up to and including that module), or a list
of ``modules``. A name is a module path of the built model (``features.layer2``) or a path inside its trunk
(``layer2``, short for ``features.layer2``); an unknown name is an input error listing the names there are.

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


@dataclass(frozen=True)
class FreezeSpec:
    """What ``model.freeze`` asks for: everything up to ``until`` (inclusive), and/or the listed ``modules``."""

    until: str | None = None
    modules: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> FreezeSpec | None:
        """From a config's (or checkpoint's saved config's) ``model.freeze`` section; None when nothing is frozen."""
        if not d:
            return None
        return cls(d.get("until"), tuple(d.get("modules") or ()))

    def describe(self) -> str:
        parts = ([f"until {self.until}"] if self.until else []) + ([", ".join(self.modules)] if self.modules else [])
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
    top = [n for n, _ in model.named_children()]
    trunk = getattr(model, TRUNK, None)
    inner = [n for n, _ in trunk.named_children()] if trunk is not None else []
    return top + inner


def resolve_module(model: nn.Module, name: str, key: str) -> str:
    """The full module path ``name`` means (``layer2`` -> ``features.layer2``); an input error when there is none."""
    paths = {n for n, _ in model.named_modules() if n}
    for candidate in (name, f"{TRUNK}.{name}"):
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


def frozen_paths(model: nn.Module, spec: FreezeSpec) -> list[str]:
    """Every module path (descendants included) that ``spec`` freezes, in the model's order."""
    paths = [n for n, _ in model.named_modules() if n]
    chosen: set[str] = set()
    if spec.until is not None:
        target = resolve_module(model, spec.until, "model.freeze.until")
        end = max(i for i, p in enumerate(paths) if p == target or p.startswith(target + "."))
        # everything before the target's last descendant, except the target's ancestors (they hold later layers too)
        chosen |= {p for p in paths[: end + 1] if not target.startswith(p + ".")}
    for name in spec.modules:
        chosen |= set(_covered(paths, resolve_module(model, name, "model.freeze.modules")))
    return [p for p in paths if p in chosen]


def apply_freeze(model: nn.Module, spec: FreezeSpec | None) -> Frozen | None:
    """Freeze what ``spec`` names in place: ``requires_grad=False`` and BatchNorm in eval mode. None: nothing asked.

    Raises WsiTrainError (exit 2) for an unknown module, a choice that freezes no parameter, or one that leaves
    nothing to train. Sets ``model.frozen`` (the returned ``Frozen``) so every later reader sees the same answer.
    """
    from torch import nn

    from wsitrain.models.frozen_bn import freeze_batchnorm

    if spec is None or (spec.until is None and not spec.modules):
        model.frozen = None
        return None
    paths = frozen_paths(model, spec)
    mods = dict(model.named_modules())
    frozen_params: list[str] = []
    seen: set[int] = set()
    for p in paths:
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
