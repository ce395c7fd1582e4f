"""``model.lora``: low-rank adapters on a patch encoder's layers, through ``peft`` (optional extra ``wsitrain[lora]``).

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` (or ``Conv2d``) of the encoder in place by a
LoRA layer ``W x + (alpha / rank) B A x`` and freezes every other encoder parameter; the head (everything after the
encoder) stays trainable. The model keeps its own classes and module paths, so the engine, ``model.freeze`` and the
run's checkpoints see plain modules: the adapters are ordinary parameters (``...qkv.lora_A.default.weight``) of the
model's state dict, saved with every checkpoint and loaded on resume and prediction (the model is built with the
same ``model.lora``, then its state is loaded). ``merge_lora`` folds them into the base weights for export.

Targets are peft's ``target_modules``: a module name matches when it equals a target or ends with ``.<target>``
(``qkv`` is every ``blocks.N.attn.qkv`` of a timm ViT; ``blocks.11.attn.qkv`` only the last block's).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from torch import nn

from wsitrain.errors import WsiTrainError

DEFAULT_TARGETS = ("qkv",)  # timm ViTs' fused query-key-value projection, LoRA's original target (Hu et al. 2021)
ADAPTER = "default"  # peft's adapter name: one adapter per model


@dataclass(frozen=True)
class LoraSpec:
    """What ``model.lora`` asks for."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, object] | None) -> LoraSpec | None:
        """From a config's (or a checkpoint's saved config's) ``model.lora`` section; None without one."""
        if not d:
            return None
        return cls(int(d["rank"]), float(d["alpha"]), tuple(d["targets"]), float(d.get("dropout") or 0.0))  # type: ignore[arg-type]


def _need_peft() -> None:
    if importlib.util.find_spec("peft") is None:
        raise WsiTrainError("model.lora needs the optional package peft, which is not installed",
                            hint="pip install 'wsitrain[lora]'")  # fmt: skip


def _leaf_names(encoder: nn.Module) -> list[str]:
    """The last name of every Linear / Conv2d in the encoder (what a target can name), each once."""
    names = [n.rsplit(".", 1)[-1] for n, m in encoder.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    return sorted(set(names))


def apply_lora(encoder: nn.Module, spec: LoraSpec, name: str = "the encoder") -> int:
    """Put LoRA adapters on ``spec.targets`` of ``encoder`` in place (its other parameters frozen); returns how many
    layers were adapted. WsiTrainError (exit 2) when a target names no layer of the encoder."""
    _need_peft()
    from peft import LoraConfig, inject_adapter_in_model

    leaves = _leaf_names(encoder)
    paths = [n for n, _ in encoder.named_modules()]
    unmatched = [t for t in spec.targets if not any(p == t or p.endswith(f".{t}") for p in paths)]
    if unmatched:
        raise WsiTrainError(f"model.lora.targets: {name} has no layer {', '.join(map(repr, unmatched))}",
                            hint=f"name its Linear or Conv2d layers by their last name ({', '.join(leaves)}) or by "
                            "a path ending in one (blocks.11.attn.qkv)")  # fmt: skip
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                        lora_dropout=spec.dropout, bias="none")  # fmt: skip
    try:
        inject_adapter_in_model(config, encoder, adapter_name=ADAPTER)
    except ValueError as exc:  # a target that is no layer type LoRA supports (a norm, a block)
        raise WsiTrainError(f"model.lora.targets: {exc}", hint=f"name Linear or Conv2d layers: {', '.join(leaves)}") \
            from exc  # fmt: skip
    return len(lora_layers(encoder))


def lora_layers(module: nn.Module) -> list[str]:
    """Module paths of the LoRA layers in ``module``."""
    from peft.tuners.lora import LoraLayer

    return [n for n, m in module.named_modules() if isinstance(m, LoraLayer)]


def has_lora_keys(state: dict[str, object]) -> bool:
    """Whether a state dict holds LoRA adapters (a run trained with ``model.lora``)."""
    return any(".lora_A." in k for k in state)


def merge_lora(module: nn.Module) -> nn.Module:
    """Fold every adapter into its base layer and put the base layer back in its place (in place; returns
    ``module``): the plain architecture, with ``W + (alpha / rank) B A`` as its weights."""
    for path in lora_layers(module):
        layer = module.get_submodule(path)
        layer.merge(adapter_names=[ADAPTER])
        parent, _, child = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, layer.get_base_layer())
    return module


def add_lora(model: nn.Module, spec: LoraSpec, freeze: object = None) -> int:
    """Put ``spec``'s adapters on a built patch model's encoder (``features.encoder``), then apply ``model.freeze``
    (a ``FreezeSpec``) again so adapters inside frozen blocks stay fixed too. Returns the layers adapted."""
    from wsitrain.models.freeze import apply_freeze
    from wsitrain.patch.blocks import patch_encoder

    encoder = patch_encoder(model)
    if encoder is None:
        raise WsiTrainError(f"model.lora applies to patch encoders; {getattr(model, 'name', 'the model')} tiles the "
                            "whole slide", hint="set model.patch, or remove model.lora")  # fmt: skip
    n = apply_lora(encoder, spec, str(getattr(model, "name", "the encoder")))
    apply_freeze(model, freeze)  # type: ignore[arg-type]
    return n
