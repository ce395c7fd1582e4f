"""``wsitrain plan --config RUN.yaml``: plan the model a run's config trains, not only a model name and a pool.

The config's ``model`` section builds the model exactly as ``wsitrain fit`` does (``wsitrain.train.engine.
build_model``): the attention head with every ``model.attention`` key, ``map_norm``, ``topk``, ``freeze`` and
``freeze_bn`` and ``bn_stats`` (BatchNorm in training mode adds sweeps). ``train.precision``, ``train.optimizer``,
``engine.memory_budget``, ``engine.tile_size``, ``engine.host_memory`` and ``data.size`` (or ``data.synthetic.size``)
fill what the command line leaves out; an option given on the command line wins, except the ones that describe the
model, which the config owns (giving both is an error, so a plan never mixes two models). The weights are not read:
a plan needs shapes only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from wsitrain.config import WsiTrainConfig, load_config
from wsitrain.errors import WsiTrainError
from wsitrain.models.freeze import FreezeSpec

PLAN_NUM_CLASSES = 2  # the head is tiny next to the trunk; any class count plans the same

# make(frozen) builds the model on the current (meta) device, with its freeze spec or with nothing frozen
ModelMaker = Callable[[bool], nn.Module]


@dataclass(frozen=True)
class ConfigPlan:
    """What a config says about the plan: the model's builder and the inputs the command line did not give."""

    model: str  # model.name
    make: ModelMaker
    freeze: FreezeSpec | None  # model.freeze
    precision: str
    optimizer: str
    memory: str | None  # engine.memory_budget when neither --gpu nor --memory is given
    memory_source: str | None  # where ``memory`` came from when the config gave it (the plan's "budget source")
    tile: int | None
    size: str | None  # data.size as --size writes it (HxW), when the config fixes it
    host_memory: str | int | None  # engine.host_memory when --host-memory is not given
    fold_bn: bool = True  # engine.fold_bn


def _size_text(cfg: WsiTrainConfig) -> str | None:
    """``data.size`` (a fixed read), else a synthetic cohort's slide edge; None when slides decide it."""
    size = cfg.data.size
    if size is None:
        return None if cfg.data.synthetic is None else str(cfg.data.synthetic.size)
    if isinstance(size, int):
        return str(size)
    return f"{size[0]}x{size[1]}"


def from_config(
    path: str | Path,
    *,
    model_options: dict[str, object],
    precision: str | None,
    gpu: str | None,
    memory: str | None,
    tile: int | None,
    size: str | None,
    host_memory: str | int | None = None,
) -> ConfigPlan:
    """Read ``path`` (exit 2 on any problem, as ``wsitrain validate``) and say what to plan.

    ``model_options``: the command's model options by flag (``{"--model": None, "--pool": "max", ...}``); any
    that is given conflicts with the config's ``model`` section."""
    given = [flag for flag, value in model_options.items() if value is not None]
    if given:
        raise WsiTrainError(
            f"{', '.join(given)}: --config {path} already says which model to plan (its model section)",
            hint=f"drop {', '.join(given)}, or drop --config and give --model (and --pool ...) alone",
        )
    cfg = load_config(path)
    # imported here: the run's own model builder (wsitrain.train imports the engine, which plan needs anyway)
    from wsitrain.train.engine import build_model

    m = cfg.model
    num_classes = m.num_classes or PLAN_NUM_CLASSES

    def make(frozen: bool) -> nn.Module:  # shapes only: the weights file is never read
        return build_model(m if frozen else m.model_copy(update={"freeze": None}), num_classes, with_weights=False)

    e = cfg.engine
    from_cfg = gpu is None and memory is None and e.memory_budget is not None
    budget = e.memory_budget if from_cfg else memory
    return ConfigPlan(
        model=m.name, make=make, freeze=m.freeze_spec(), precision=precision or cfg.train.precision,
        optimizer=cfg.train.optimizer, memory=None if budget is None else str(budget),
        memory_source=f"engine.memory_budget {e.memory_budget} ({path})" if from_cfg else None,
        tile=tile if tile is not None else e.tile_size, size=size or _size_text(cfg),
        host_memory=host_memory if host_memory is not None else e.host_memory, fold_bn=e.fold_bn,
    )  # fmt: skip
