"""The run config: a YAML file validated by pydantic models, with dotted ``--set`` overrides.

Every section forbids unknown keys, so a typo fails loudly instead of silently using a default.
All problems in a file (and in its overrides) are collected and raised as one ``ConfigError``.

Relative paths (``data.labels``, ``data.slides_dir``, ``model.weights``, ``log.dir`` ...) are resolved against the
current working directory, not the config file's folder: users run ``wsitrain`` from the project root, and the
example configs in ``configs/`` are written for that.

To add a key: add a field to the section class below (with a default, so old configs stay valid) and give it an entry
in docs/reference/config.md (type, default, meaning; tests/test_docs_reference.py fails until it has one).
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from wsitrain.errors import ConfigError, WsiTrainError
from wsitrain.models.freeze import FreezeSpec
from wsitrain.models.heads import (
    ATTENTION_NORMS,
    ATTENTION_POOLS,
    DEFAULT_INSTANCE_CELLS,
    DEFAULT_INSTANCE_POSITIVE_CELLS,
    DEFAULT_TOPK,
    MAP_NORMS,
    NO_NORM,
    POOLS,
    TOPK,
    AttentionSpec,
    attention_border,
    carried_scores,
    positive_index,
)
from wsitrain.models.registry import ModelNameError, is_imagenet, resolve_model_name
from wsitrain.models.slide_bn import BN_STATS, RUNNING
from wsitrain.models.slide_bn import SLIDE as SLIDE_STATS
from wsitrain.precision import Precision
from wsitrain.slides.tissue.result import DEFAULT_MIN_FRAGMENT_MM2, TissueSettings
from wsitrain.spill_dir import folder_problem
from wsitrain.tasks.kinds import RegressionLoss, TaskKind
from wsitrain.train.head_warmup import LAYOUTS, PATCHES
from wsitrain.units import format_bytes, parse_bytes

# ``~`` is expanded; relative paths stay relative (to the working directory, see module docstring).
UserPath = Annotated[Path, AfterValidator(lambda p: p.expanduser())]


def _base_types(annotation: Any) -> set[Any]:
    """Every plain type an annotation admits, through unions, Annotated, tuples and lists."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _base_types(get_args(annotation)[0])
    if origin in (Union, types.UnionType, tuple, list):
        return set().union(*(_base_types(a) for a in get_args(annotation) if a is not Ellipsis))
    return {annotation}


def _has_bool(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, (list, tuple)) and any(_has_bool(v) for v in value))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; true/false is never a number."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1 for an int field, so `train.epochs: true` would train one epoch.
        if _has_bool(value) and info.field_name is not None:
            admitted = _base_types(cls.model_fields[info.field_name].annotation)
            if admitted & {int, float} and bool not in admitted:
                raise ValueError(f"expected a number, got {json.dumps(value)} (true/false is not a number)")
        return value


def one_of(value: str, choices: Sequence[str], what: str) -> str:
    """``value`` when it is one of a vocabulary's ``choices``; else the error naming them."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return value


def check_run_name(name: str, what: str = "name") -> str | None:
    """A problem text when ``name`` cannot be a run folder directly inside log.dir, else None.

    A run name is one plain folder name: no ``/`` or ``\\``, not ``.`` or ``..``, not hidden (leading ``.``),
    so a run can never be written outside log.dir or hide in it.
    """
    if not name.strip():
        return f"{what}: the run name is empty; give a folder name such as lr-1e-4"
    example = "a run name is one folder name inside log.dir (e.g. lr-1e-4)"
    if "/" in name or "\\" in name:
        return f"{what}: {name!r} contains a path separator; {example}"
    if name in (".", ".."):
        return f"{what}: {name!r} is not a folder inside log.dir; {example}"
    if name.startswith("."):
        return f"{what}: {name!r} starts with '.'; a run name is a visible folder name inside log.dir (e.g. lr-1e-4)"
    return None


class SyntheticConfig(Section):
    n: int = Field(24, ge=2)
    size: int = Field(1024, ge=64)
    seed: int = 0
    positive_fraction: float = Field(0.5, gt=0, lt=1)
    cache_dir: UserPath = Path(".cache/wsitrain/synthetic")


class AugmentConfig(Section):
    flips: bool = True
    rot90: bool = True
    color_jitter: Literal["none", "hsv", "hed"] = "none"
    jitter_strength: float = Field(0.05, ge=0, le=1)


class TissueConfig(Section):
    """``data.tissue``: how the tissue detector keeps pieces (wsitrain/slides/tissue)."""

    # Pieces of tissue at least this large (mm² at the slide's mpp) are kept, however far from the others; smaller
    # ones are dropped as specks. Default 0.001 mm² (about 32 um across): keeps a 0.005 mm² biopsy fragment with room
    # to spare. Pen strokes, dust and labels are dropped by colour and shape whatever their size.
    min_fragment_mm2: float = Field(DEFAULT_MIN_FRAGMENT_MM2, gt=0, le=100)

    def settings(self, fallback_mpp: float | None) -> TissueSettings:
        return TissueSettings(min_fragment_mm2=self.min_fragment_mm2, fallback_mpp=fallback_mpp)


class DataConfig(Section):
    labels: UserPath | None = None
    slides_dir: UserPath | None = None
    synthetic: SyntheticConfig | None = None
    level: int | None = Field(None, ge=0)
    mpp: float | None = Field(None, gt=0)
    magnification: float | None = Field(None, gt=0)
    fallback_mpp: float | None = Field(None, gt=0)
    region: Literal["whole", "tissue", "fixed"] = "tissue"
    size: Annotated[int, Field(gt=0)] | tuple[Annotated[int, Field(gt=0)], Annotated[int, Field(gt=0)]] | None = None
    background: tuple[
        Annotated[int, Field(ge=0, le=255)], Annotated[int, Field(ge=0, le=255)], Annotated[int, Field(ge=0, le=255)]
    ] = (255, 255, 255)
    # Each side is padded (background colour) up to a ladder of edges with this many steps per doubling, so few
    # distinct shapes (engine plans) exist: 4 grows a side by at most ~25%; null plans every slide shape on its own.
    bucket: Annotated[int, Field(ge=1, le=64, strict=True)] | None = 4
    val_fraction: float = Field(0.25, ge=0, lt=1)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    prefetch: bool = True
    # Threads decoding one slide's chunks at once; auto: the cores this process may use, at most 8 (never more than
    # the slide has chunks). Each chunk fills its own part of the output, so any count reads the same bytes.
    read_threads: int | Literal["auto"] = "auto"
    # Pixels outside the detected tissue (its thumbnail mask grown by one thumbnail pixel, so edges are never cut)
    # become the background colour, and chunks wholly outside it are not decoded: background is then one constant
    # colour (pen marks and dust outside tissue go too). Strict: 1, "yes" or "true" in quotes are not taken as true.
    mask_background: Annotated[bool, Field(strict=True)] = True
    # Read the slide tile by tile into the first tiled segment (slides/tile_source.py) instead of decoding the whole
    # image into host memory first: host memory holds a few tiles, not the slide; the step is bitwise the same.
    # Each tile is decoded again by the backward recompute (and by each sweep of a BatchNorm segment), so the slide
    # is decoded two or more times per step: off by default, for slides that fit the host. A plan whose first
    # segment is not tiled reads the whole image as before.
    stream_tiles: Annotated[bool, Field(strict=True)] = False
    # With stream_tiles: host memory for decoded regions kept through the step, so the backward recompute takes the
    # first ones from memory instead of decoding them again (slides/tile_source.py); 0: none. Counted by preflight.
    stream_cache: int | str = 0
    tissue: TissueConfig = Field(default_factory=TissueConfig)

    @field_validator("stream_cache")
    @classmethod
    def _check_stream_cache(cls, value: int | str) -> int | str:
        if value in (0, "0"):
            return 0
        try:
            parse_bytes(value, what="stream_cache")
        except WsiTrainError as err:
            raise ValueError(f"cannot read {value!r} as a size; write e.g. 256MiB, or 0 for no cache") from err
        return value

    @property
    def stream_cache_bytes(self) -> int:
        return 0 if self.stream_cache == 0 else parse_bytes(self.stream_cache, what="data.stream_cache")

    def tissue_settings(self) -> TissueSettings:
        """The tissue detector's settings (a slide without mpp is measured at data.fallback_mpp when set)."""
        return self.tissue.settings(self.fallback_mpp)

    @field_validator("read_threads", mode="before")
    @classmethod
    def _check_read_threads(cls, value: Any) -> Any:
        # One message for the whole int-or-auto choice (a union would report each branch's complaint).
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 256):
            return value
        raise ValueError(f"expected a whole number from 1 to 256 or auto, got {value!r}")

    @model_validator(mode="after")
    def _check_combinations(self) -> DataConfig:
        chosen = [k for k in ("level", "mpp", "magnification") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(
                f"{' and '.join(chosen)} are both set; set exactly one of level, mpp, magnification "
                "(or none, which reads level 0)"
            )
        if self.region == "fixed" and self.size is None:
            raise ValueError("region is 'fixed' but size is not set; set data.size (e.g. 20480 or [20480, 10240])")
        if self.region != "fixed" and self.size is not None:
            raise ValueError(
                f"size is set but region is '{self.region}'; size applies only to region 'fixed' "
                "(remove data.size, or set data.region: fixed)"
            )
        if self.labels is not None and self.synthetic is not None:
            raise ValueError("labels and synthetic are both set; use a labels CSV or synthetic slides, not both")
        return self


class AttentionConfig(Section):
    """``model.attention``: the attention-MIL head of ``pool: attention | gated_attention`` (models/attention.py)."""

    dim: int | None = Field(None, ge=1)  # 1x1 projection (+ ReLU) to this width first (CLAM: 512); none: trunk's
    hidden: int | None = Field(None, ge=1)  # width of the attention layers V (and U); none: min(256, the width)
    branches: Literal["single", "per_class"] = "single"  # per_class: one attention branch per class (CLAM-MB)
    # the MIL instance loss on the positive class's attention scores (wsitrain.train.instance_loss), its weight beside
    # the slide's loss; 0: off (0.1 and 0.5 measured, docs/research/plateau.md sections 10-11)
    instance_loss: float = Field(0.0, ge=0)
    # a negative slide's this many highest-scoring cells are pushed below 0
    instance_cells: int = Field(DEFAULT_INSTANCE_CELLS, ge=1, strict=True)
    # a positive slide's this many highest-scoring cells are pushed above 0 (their mean BCE)
    instance_positive_cells: int = Field(DEFAULT_INSTANCE_POSITIVE_CELLS, ge=1, strict=True)
    positive_class: str | None = None  # the class the MIL assumption calls positive; none: the second of two, sorted
    # the map's outer rings of cells the attention pool leaves out (zero padding sets them apart on every slide);
    # none: 1 with instance_loss, else 0
    border_cells: int | None = Field(None, ge=0, strict=True)
    # what the scores read (models/heads.py ATTENTION_NORMS): none, the trunk's map; slide, each channel standardised
    # over the slide's map; cell, each cell's vector over its channels
    norm: str = NO_NORM
    # the positive class's logit adds the mean of its branch's instance_positive_cells highest scores (DSMIL's
    # max-instance stream): the instance loss's logits decide the slide too
    instance_stream: bool = False

    _known_norm = field_validator("norm")(lambda value: one_of(value, ATTENTION_NORMS, "norm"))

    @model_validator(mode="after")
    def _instance_keys_need_the_loss(self) -> AttentionConfig:
        # not "was it set": config_to_dict writes every key, and its round trip must load
        extra = (self.positive_class is not None or self.instance_cells != DEFAULT_INSTANCE_CELLS
                 or self.instance_positive_cells != DEFAULT_INSTANCE_POSITIVE_CELLS)  # fmt: skip
        if self.instance_loss == 0 and extra:
            raise ValueError("model.attention.instance_cells, instance_positive_cells and positive_class apply to "
                             "instance_loss, which is 0 "
                             "(set model.attention.instance_loss, e.g. 0.5, or remove them)")  # fmt: skip
        if self.instance_stream and (self.instance_loss == 0 or self.branches != "per_class"):
            raise ValueError("model.attention.instance_stream adds the positive branch's instance scores to its "
                             "class's logit, so it needs instance_loss > 0 and branches: per_class "
                             "(set both, e.g. instance_loss: 0.1, or remove instance_stream)")  # fmt: skip
        return self

    def spec(self, class_names: Sequence[str] | None = None) -> AttentionSpec:
        """The build's spec; ``class_names`` (the run's) place the instance stream on the positive class."""
        k = carried_scores(self.instance_loss, self.instance_cells, self.instance_positive_cells)
        stream = positive_index(self.positive_class, class_names) if self.instance_stream else None
        return AttentionSpec(self.dim, self.hidden, self.branches == "per_class", k,
                             attention_border(self.instance_loss, self.border_cells), self.norm, stream,
                             self.instance_positive_cells)  # fmt: skip


class FreezeConfig(Section):
    """``model.freeze``: what stays fixed while fine-tuning (wsitrain.models.freeze). ``freeze: layer2`` is short for
    ``until: layer2``; a list is ``modules``. Names are checked against the built model (an unknown one lists them)."""

    until: str | None = None  # every layer from the input up to and including this module
    modules: list[str] | None = None  # these modules (and everything inside them)
    # patch encoders: only the encoder's last N blocks (and what follows them) train; 0: the whole encoder is frozen
    last_blocks: int | None = Field(None, ge=0, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _short_forms(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"until": value}
        if isinstance(value, list):
            return {"modules": value}
        return value

    @model_validator(mode="after")
    def _something(self) -> FreezeConfig:
        if self.until is None and not self.modules and self.last_blocks is None:
            raise ValueError("names no module; write e.g. freeze: {until: layer2} or freeze: [features.conv1], "
                             "or freeze: {last_blocks: 2} for a patch encoder, or remove model.freeze")  # fmt: skip
        if self.until is not None and self.last_blocks is not None:
            raise ValueError("until and last_blocks both say where the frozen part ends; keep one")
        for name in ([self.until] if self.until is not None else []) + list(self.modules or []):
            if not name.strip() or name != name.strip():
                raise ValueError(f"{name!r} is not a module name (e.g. layer2 or features.layer2)")
        return self

    def spec(self) -> FreezeSpec:
        return FreezeSpec(self.until, tuple(self.modules or ()), self.last_blocks)


class LoraConfig(Section):
    """``model.lora``: low-rank adapters on the patch encoder's layers (wsitrain.patch.lora, through peft); the
    encoder's own weights stay fixed, the adapters and the head train."""

    rank: int = Field(8, ge=1, strict=True)  # r: the adapters' inner width
    alpha: float = Field(16.0, gt=0)  # the adapters' output is scaled by alpha / rank
    # layers adapted, by name or a path ending in one (peft's target_modules): timm ViTs' attention projection
    targets: list[str] = Field(default_factory=lambda: ["qkv"], min_length=1)
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapters' input, in training

    @field_validator("targets")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name.strip() or name != name.strip():
                raise ValueError(f"{name!r} is not a layer name (e.g. qkv, proj, fc1, or blocks.11.attn.qkv)")
        return value

    def spec(self) -> Any:
        from wsitrain.patch.lora import LoraSpec

        return LoraSpec(self.rank, self.alpha, tuple(self.targets), self.dropout)


class ModelConfig(Section):
    name: str = "tiny"  # a built-in, torchvision/<name> or timm/<name>: checked by wsitrain.models' one registry
    num_classes: int | None = Field(None, ge=1)
    # a state dict (the model's, or its trunk's alone), a wsitrain run checkpoint (best.pt), or `imagenet`
    weights: UserPath | None = None
    pool: str = "avg"  # one of wsitrain.models.heads.POOLS
    attention: AttentionConfig = AttentionConfig()
    # pool: topk's k: each channel pools the mean of its k strongest tissue positions (wsitrain.sft.ops.topk_pool)
    topk: int = Field(DEFAULT_TOPK, ge=1, strict=True)
    freeze_bn: bool = True
    freeze: FreezeConfig | None = None  # fine-tuning: layers kept fixed (forward-only in the engine)
    # px at the run's resolution: the model is a patch encoder applied to every patch of this size (its embeddings the
    # map the head pools). None: a CNN tiles the whole slide; a ViT / hub / python: encoder uses its own input size
    patch: int | None = Field(None, ge=2, strict=True)
    lora: LoraConfig | None = None  # patch encoders: low-rank adapters trained instead of the encoder's weights
    # "slide": the head reads the trunk's map standardised per channel over the slide (wsitrain.models.zoo.build)
    map_norm: str = NO_NORM
    # with freeze_bn: false, "slide" normalises with each slide's own statistics in prediction too, as in training
    # (wsitrain.models.slide_bn); "running": PyTorch's running averages outside training
    bn_stats: str = RUNNING

    def freeze_spec(self) -> FreezeSpec | None:
        return self.freeze.spec() if self.freeze is not None else None
    # with data.mask_background, max and average pools reduce over the slide's tissue only (attention always does):
    # no class decided on the background or the image border (docs/guide/models.md; false: the whole map, as before)
    mask_pool: Annotated[bool, Field(strict=True)] = True

    _known_pool = field_validator("pool")(lambda value: one_of(value, POOLS, "pool"))
    _known_map_norm = field_validator("map_norm")(lambda value: one_of(value, MAP_NORMS, "map_norm"))
    _known_bn_stats = field_validator("bn_stats")(lambda value: one_of(value, BN_STATS, "bn_stats"))

    @model_validator(mode="after")
    def _slide_stats_need_trainable_batchnorm(self) -> ModelConfig:
        if self.bn_stats == SLIDE_STATS and self.freeze_bn:
            raise ValueError("model.bn_stats: slide normalises with each slide's own statistics, but model.freeze_bn "
                             "(true by default) keeps the running ones; set model.freeze_bn: false as well")
        return self

    @model_validator(mode="after")
    def _attention_needs_attention_pool(self) -> ModelConfig:
        if self.pool not in ATTENTION_POOLS and self.attention != AttentionConfig():
            raise ValueError(
                f"model.attention applies to pool: {' or '.join(ATTENTION_POOLS)}, but model.pool is {self.pool!r}"
            )
        return self

    @model_validator(mode="after")
    def _topk_needs_topk_pool(self) -> ModelConfig:
        # not "was it set": config_to_dict writes every key, and its round trip must load (as model.attention's)
        if self.topk != DEFAULT_TOPK and self.pool != TOPK:
            raise ValueError(f"model.topk applies to pool: {TOPK}, but model.pool is {self.pool!r}")
        return self

    @field_validator("name")
    @classmethod
    def _known_model(cls, value: str) -> str:
        try:
            resolve_model_name(value)
        except ModelNameError as e:
            raise ValueError(e.reason) from e
        return value

    @model_validator(mode="after")
    def _patch_encoder_keys(self) -> ModelConfig:
        try:
            spec = resolve_model_name(self.name)
        except ModelNameError:
            return self  # said by the name's own validator
        if spec.source == "python" and self.patch is None:
            raise ValueError(f"model.patch is required with {self.name}: the px edge of the patches its module takes")
        encoder = spec.patch_only or self.patch is not None
        if self.lora is not None and not encoder:
            raise ValueError(f"model.lora applies to patch encoders; {self.name} tiles the whole slide (set "
                             "model.patch to use it as a patch encoder, or remove model.lora)")  # fmt: skip
        if self.freeze is not None and self.freeze.last_blocks is not None and not encoder:
            raise ValueError(f"model.freeze.last_blocks applies to patch encoders; {self.name} tiles the whole slide "
                             "(use model.freeze.until with one of its modules, or set model.patch)")  # fmt: skip
        return self

    def lora_spec(self) -> Any:
        """The build's ``wsitrain.patch.lora.LoraSpec``, or None without ``model.lora``."""
        return self.lora.spec() if self.lora is not None else None


class EngineConfig(Section):
    memory_budget: int | str | None = None
    tile_size: int | None = Field(None, gt=0)
    checkpoints: list[str] | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # host RAM per rank for host checkpoints (and the image on the host); what it does not hold spills to
    # spill_dir. None: the node's RAM divided among its ranks (wsitrain/spill_dir.py)
    host_memory: int | str | None = None
    spill_dir: str | None = None  # memory-mapped spill files; None: the system temp folder
    # the last tiled segment back-propagates in forward where the head and loss allow it (wsitrain/sft/ops/
    # linear_head.py); false: every tiled segment recomputes in backward
    one_pass: bool = True
    # a frozen (eval-mode) BatchNorm after a convolution folds into the convolution's weight and bias, recomputed from
    # the original parameters every step (wsitrain/sft/ops/fold_bn.py: no BatchNorm kernel runs; the same outputs and
    # gradients up to rounding); false: every BatchNorm runs as itself
    fold_bn: bool = True

    @field_validator("host_memory")
    @classmethod
    def _check_host_memory(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            try:
                parse_bytes(value, what="host_memory")
            except WsiTrainError as err:
                raise ValueError(f"cannot read {value!r} as a size; write e.g. 16GiB or 64GB") from err
        return value

    @field_validator("spill_dir")
    @classmethod
    def _check_spill_dir(cls, value: str | None) -> str | None:
        if value is not None:
            problem = folder_problem(value)
            if problem is not None:
                raise ValueError(f"{problem}; give a writable folder on a local disk, or remove the key (the system "
                                 "temp folder)")  # fmt: skip
        return value

    @property
    def host_memory_bytes(self) -> int | None:
        """The host RAM budget per rank in bytes, or None for the default (the node's RAM over its ranks)."""
        return None if self.host_memory is None else parse_bytes(self.host_memory, what="engine.host_memory")

    @field_validator("memory_budget")
    @classmethod
    def _check_budget(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            try:
                parse_bytes(value, what="memory_budget")
            except WsiTrainError as err:
                raise ValueError(f"cannot read {value!r} as a size; write e.g. 11GiB, 24GB or 512MiB") from err
        return value

    @property
    def memory_budget_bytes(self) -> int | None:
        """The budget in bytes, or None when it should be detected from the device."""
        return None if self.memory_budget is None else parse_bytes(self.memory_budget, what="engine.memory_budget")


class HeadWarmupConfig(Section):
    """``train.head_warmup``: head-only steps on the initial trunk's patch features before end-to-end training
    (wsitrain.train.head_warmup). ``head_warmup: 2000`` is short for ``{steps: 2000}``."""

    steps: int = Field(2000, ge=1, strict=True)  # head-only AdamW steps, one training slide's bag each
    patch: int = Field(64, ge=8, strict=True)  # patch edge in px at the read's resolution
    lr: float | None = Field(None, gt=0)  # none: train.lr
    # Share of each class's training slides whose bags only score the warm-up: the head kept is the one with their
    # lowest loss, and it is kept only if that beats a constant output (docs/research/plateau.md section 17). 0: every
    # bag trains it, for all its steps, and the keep rule reads its training loss.
    hold_out: float = Field(0.0, ge=0, lt=1)
    patience: int = Field(200, ge=1, strict=True)  # with hold_out: passes over the bags without a new lowest, then stop
    # patches: one vector per patch (its cells averaged), every patch; map: each patch's cells where they lie in the
    # slide's map, pooled under the tissue mask as end to end (docs/research/plateau.md section 17). patch must then be
    # a multiple of the model's stride.
    layout: str = PATCHES  # one of wsitrain.train.head_warmup.LAYOUTS

    _known_layout = field_validator("layout")(lambda value: one_of(value, LAYOUTS, "train.head_warmup.layout"))

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return {"steps": value}
        return value


class TrainConfig(Section):
    epochs: int = Field(10, ge=1)
    optimizer: Literal["sgd", "adam", "adamw"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    momentum: float = Field(0.9, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    schedule: Literal["constant", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    loss: Literal["cross_entropy", "mse"] = "cross_entropy"
    accumulate: int = Field(1, ge=1)
    clip_grad_norm: float | None = Field(None, gt=0)
    precision: Precision = "fp32"
    # The trunk's learning rate is lr times this (the head, everything after model.features, trains at lr): fine-tuning
    # a pretrained trunk gently while a fresh head learns fast. 1: one learning rate for all.
    backbone_lr_scale: float = Field(1.0, gt=0, le=1)
    # Layer-wise learning-rate decay (ViT fine-tuning): of the trunk's n blocks, block i (0-based) trains at
    # lr * layer_decay ** (n - i), the patch embedding below them at layer_decay ** (n + 1), the head at lr. None: off.
    layer_decay: float | None = Field(None, gt=0, le=1)
    # Imbalanced classes: "weights" weighs each slide's loss by n / (classes * n_class) of the training set,
    # "sampling" draws each epoch's slides with those weights (with replacement, as many as there are); none: as is.
    class_balance: Literal["none", "weights", "sampling"] = "none"
    # Before the first epoch of a new run, the head alone learns on the initial trunk's patch features (the attention
    # head then no longer starts uniform: docs/research/plateau.md section 6). None: end to end from the first step.
    head_warmup: HeadWarmupConfig | None = None
    # A patch encoder frozen whole: "auto" trains the head on embeddings cached once per slide and augmentation under
    # <log.dir>/feature_cache (the CLAM / TRIDENT pipeline, wsitrain.train.cached_head); "off": end to end always.
    feature_cache: Literal["auto", "off"] = "auto"
    val_every: int = Field(1, ge=1)
    # Also write last.pt every N optimizer steps (not only at each epoch's end), so a killed run loses little.
    checkpoint_every: int | None = Field(None, ge=1)
    # Also write last.pt when this many minutes passed since the last one: bounds what a KILL (no signal) can lose.
    checkpoint_minutes: float | None = Field(None, gt=0)
    # A signal that stops the run cleanly besides SIGTERM and SIGINT, e.g. USR1 for `sbatch --signal=B:USR1@120`.
    stop_signal: str | None = None

    @model_validator(mode="after")
    def _warmup_needs_cross_entropy(self) -> TrainConfig:
        if self.head_warmup is not None and self.loss != "cross_entropy":
            raise ValueError("train.head_warmup trains a classifier head with cross-entropy; remove it for loss: mse")
        return self

    @field_validator("stop_signal")
    @classmethod
    def _known_signal(cls, value: str | None) -> str | None:
        if value is None:
            return None
        import signal

        text = str(value).strip().upper()
        name = text if text.startswith("SIG") else f"SIG{text}"
        if text.isdigit() or name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"{value!r} is not a signal that can be caught by name; use e.g. USR1, USR2 or TERM")
        return name


class LogConfig(Section):
    dir: UserPath = Path("runs")
    tiles: Literal["all", "summary", "off"] = "summary"
    tensorboard: bool = False
    every: int = Field(1, ge=1)
    # Each new exact slide shape gets its own engine plan: "line" prints one line per new plan (a cohort has hundreds
    # of shapes; a 40-slide fit printed the 12-line plan 24 times), "full" prints the whole plan. plan.txt and
    # plans.jsonl in the run folder hold every full plan either way.
    plans: Literal["line", "full"] = "line"

    @field_validator("tiles", mode="before")
    @classmethod
    def _unquoted_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false; the user meant the choice "off".
        return "off" if value is False else value


# How long a collective waits for the slowest rank before the job is killed. NCCL's default is 10 minutes, but
# ranks train whole slides of different sizes (steps can differ by minutes), a validation pass waits on the rank
# with the largest slides, and rank 0 writes checkpoints and figures while the others wait: 60 minutes covers that
# and still ends a truly hung job within the hour.
COLLECTIVE_TIMEOUT_MINUTES = 60.0


class DistributedConfig(Section):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    bucket_mb: float = Field(25.0, gt=0)
    collective_timeout_minutes: float = Field(COLLECTIVE_TIMEOUT_MINUTES, gt=0)
    # Which slides each rank trains per step (wsitrain.train.balance.deal): "time" puts slides of similar predicted step
    # time into the same step so ranks wait less for the slowest; "round_robin" deals the shuffled order out in turn.
    balance: Literal["time", "round_robin"] = "time"


class TaskConfig(Section):
    """What the run learns (wsitrain.tasks.kinds): the labels CSV's columns it reads, and the task's loss."""

    kind: TaskKind = "classification"
    # regression: the numeric target columns; multilabel: the 0/1 label columns (one head output each)
    columns: list[str] | None = None
    time: str = "time"  # survival: follow-up time column (any unit; bins come from the training event times)
    event: str = "event"  # survival: 1 = the event happened at `time`, 0 = censored then
    loss: RegressionLoss = "mse"  # regression only (classification keeps train.loss)
    bins: int = Field(4, ge=2, le=64)  # survival: time bins at the training set's event-time quantiles

    @model_validator(mode="before")
    @classmethod
    def _kind_alone(cls, value: Any) -> Any:
        # `task: survival` is short for `task: {kind: survival}`.
        return {"kind": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_columns(self) -> TaskConfig:
        if self.kind in ("regression", "multilabel"):
            if not self.columns:
                raise ValueError(f"kind is {self.kind} but columns is not set; list the labels CSV's "
                                 f"{'target' if self.kind == 'regression' else '0/1 label'} columns, "
                                 "e.g. columns: [score]")  # fmt: skip
            dupes = sorted({c for c in self.columns if self.columns.count(c) > 1})
            if dupes:
                raise ValueError(f"columns lists {', '.join(dupes)} more than once")
        elif self.columns:
            raise ValueError(f"columns is set but kind is {self.kind}; columns apply to regression and multilabel")
        if self.kind == "survival" and self.time == self.event:
            raise ValueError(f"time and event are both {self.time!r}; they name two different columns")
        return self


class WsiTrainConfig(Section):
    name: str | None = None  # the run folder's name inside log.dir (see check_run_name)
    seed: int = Field(0, ge=0)
    deterministic: bool = False
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)

    _source: Path | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        problem = None if value is None else check_run_name(value, what="name")
        if problem is not None:
            raise ValueError(problem.removeprefix("name: "))
        return value

    @property
    def source(self) -> Path | None:
        """The file this config was loaded from (None when built in code)."""
        return self._source


# --------------------------------------------------------------------------------------------------- loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: PyYAML would silently keep the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        err = ConfigError([f"file not found ({path.resolve()})"], source=str(path))
        err.hint = "check the path; example configs are in configs/, e.g. configs/demo.yaml"
        raise err
    if path.is_dir():
        raise ConfigError(["is a directory, not a YAML file"], source=str(path))
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"YAML syntax error at {where}{problem}"], source=str(path)) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"not a text file ({e.reason})"], source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"the file must hold a mapping of sections (data:, model:, train: ...), got {type(data).__name__}"],
            source=str(path),
        )
    return data


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside ``Model`` or ``Model | None``, else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        for arg in get_args(annotation):
            found = _submodel(arg)
            if found is not None:
                return found
    return None


def _takes_text_only(annotation: Any) -> bool:
    """True for str/Path fields that do not also accept numbers (so ``name=2024`` stays the text '2024')."""
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    # UserPath is Annotated[Path, ...]: compare its base type.
    args = {get_args(a)[0] if get_origin(a) is Annotated else a for a in members}
    return bool(args & {str, Path}) and not args & {int, float}


def _apply_override(data: dict[str, Any], item: str) -> str | None:
    """Apply one ``a.b.c=value`` to ``data`` in place; return a problem text instead of raising."""
    if "=" not in item:
        return f"--set {item!r}: expected KEY=VALUE, e.g. train.lr=1e-4"
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    model: type[BaseModel] = WsiTrainConfig
    node = data
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        if part not in model.model_fields:
            return f"--set {key}: unknown key {where!r}; valid keys here: {', '.join(model.model_fields)}"
        annotation = model.model_fields[part].annotation
        if i == len(parts) - 1:
            try:
                value = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                value = raw
            if _takes_text_only(annotation) and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = raw
            node[part] = value
            return None
        sub = _submodel(annotation)
        if sub is None:
            return f"--set {key}: {where!r} is a value, not a section; write --set {where}=VALUE"
        if not isinstance(node.get(part), dict):
            node[part] = {}  # absent or null section (e.g. data.synthetic: null): start an empty one
        node = node[part]
        model = sub
    return None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> WsiTrainConfig:
    """Read a YAML config, apply ``KEY=VALUE`` overrides, validate; raise one ConfigError listing every problem."""
    path = Path(path)
    data = _read_yaml(path)
    problems = [p for p in (_apply_override(data, item) for item in overrides) if p]
    try:
        cfg = WsiTrainConfig.model_validate(data)
    except ValidationError as e:
        problems += format_validation_errors(e, data)
        cfg = None
    if problems or cfg is None:
        raise ConfigError(problems, source=str(path))
    cfg._source = path
    return cfg


# --------------------------------------------------------------------------------------------------- errors

_UNION_TAGS = {"int": "a whole number", "float": "a number", "str": "text", "bool": "true or false"}
_LIMITS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _split_loc(loc: tuple[Any, ...]) -> tuple[list[str], list[int], bool]:
    """Split a pydantic error location into (field path, list indices, went through a union branch)."""
    model: type[BaseModel] | None = WsiTrainConfig
    fields: list[str] = []
    indices: list[int] = []
    union = False
    for part in loc:
        if model is not None and isinstance(part, str) and part in model.model_fields:
            fields.append(part)
            model = _submodel(model.model_fields[part].annotation)
        elif isinstance(part, int):
            indices.append(part)
        else:  # a union member tag such as 'int' or 'tuple[int, int]'
            model = None
            union = True
    return fields, indices, union


def _lookup(data: Any, keys: Iterable[str]) -> Any:
    for k in keys:
        data = data.get(k) if isinstance(data, Mapping) else None
    return data


def _describe(err: Mapping[str, Any]) -> str:
    """One pydantic error as a sentence a user can act on."""
    kind, ctx, got = err["type"], err.get("ctx") or {}, f"got {err.get('input')!r}"
    if kind == "missing":  # a tuple too short is "missing" at its first absent index
        too_short = bool(err["loc"]) and isinstance(err["loc"][-1], int)
        return "too few items in the list" if too_short else "required key is missing"
    if kind in ("float_parsing", "float_type", "finite_number"):
        return f"expected a number, {got}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"expected a whole number, {got}"
    if kind in ("bool_parsing", "bool_type"):
        return f"expected true or false, {got}"
    if kind == "string_type":
        return f"expected text, {got}"
    if kind in ("path_type",):
        return f"expected a file path, {got}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return f"{err.get('input')!r} is not a valid choice; choose one of {', '.join(choices)}"
    if kind in _LIMITS:
        limit = next(iter(ctx.values()), "?")
        return f"must be {_LIMITS[kind]} {limit}, {got}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a section of keys (a YAML mapping), {got}"
    if kind in ("tuple_type", "list_type"):
        return f"expected a list, {got}"
    if kind == "too_short":
        return f"expected at least {ctx.get('min_length', '?')} items, {got}"
    if kind == "too_long":
        return f"expected at most {ctx.get('max_length', '?')} items, {got}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return f"{err['msg']}, {got}"


def _is_type_mismatch(err: Mapping[str, Any]) -> bool:
    """The input had the wrong kind (text for a number), as opposed to a right kind with a bad value (-5 for size)."""
    return err["type"].endswith(("_type", "_parsing")) or err["type"] == "int_from_float"


def _describe_union(key: str, branches: list[Mapping[str, Any]], data: Mapping[str, Any]) -> list[str]:
    """One field of type ``A | B`` failed in every branch: report the branch whose kind matched, else what fits."""
    # A branch went past the kind check when its value was wrong (-5) or it failed inside a list item ([5, 'x']).
    matched = [b for b in branches if not _is_type_mismatch(b) or _split_loc(tuple(b["loc"]))[1]]
    if matched:
        return [f"{key}{''.join(f'[{i}]' for i in _split_loc(tuple(b['loc']))[1])}: {_describe(b)}" for b in matched]
    wanted: list[str] = []
    for b in branches:
        fields = _split_loc(tuple(b["loc"]))[0]
        tag = next((p for p in b["loc"] if isinstance(p, str) and p not in fields), "")
        tag = tag.removeprefix("constrained-")  # pydantic's tag for Annotated[int, Field(gt=0)]
        text = _UNION_TAGS.get(tag, "a list" if tag.startswith(("tuple", "list")) else tag)
        if text not in wanted:
            wanted.append(text)
    return [f"{key}: expected {' or '.join(wanted)}, got {_lookup(data, key.split('.'))!r}"]


def format_validation_errors(error: ValidationError, data: Mapping[str, Any]) -> list[str]:
    """Turn pydantic's errors into ``dotted.key: message`` lines; the branches of a union become one report."""
    problems: list[str | list[str]] = []  # a list entry is a union's slot, filled in once all its branches are seen
    unions: dict[str, list[Mapping[str, Any]]] = {}
    for err in error.errors():
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            model: type[BaseModel] | None = WsiTrainConfig
            for part in _split_loc(loc[:-1])[0]:
                model = _submodel(model.model_fields[part].annotation) if model else None
            valid = ", ".join(model.model_fields) if model else "?"
            problems.append(f"{'.'.join(map(str, loc))}: unknown key; valid keys here: {valid}")
            continue
        fields, indices, union = _split_loc(loc)
        key = ".".join(fields) or "config"
        if union:
            if key not in unions:
                unions[key] = []
                problems.append([key])
            unions[key].append(err)
            continue
        problems.append(f"{key}{''.join(f'[{i}]' for i in indices)}: {_describe(err)}")
    out: list[str] = []
    for p in problems:
        out += _describe_union(p[0], unions[p[0]], data) if isinstance(p, list) else [p]
    return out


# --------------------------------------------------------------------------------------------------- helpers


def config_to_dict(cfg: WsiTrainConfig) -> dict[str, Any]:
    """Plain JSON/YAML-able dict of every key (defaults included): paths as strings, tuples as lists."""
    return cfg.model_dump(mode="json")


def diff_configs(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts (keys present in only one count as different)."""
    out: list[str] = []
    for key in sorted(set(a) | set(b), key=str):
        va, vb = a.get(key), b.get(key)
        dotted = f"{prefix}{key}"
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out += diff_configs(va, vb, prefix=f"{dotted}.")
        elif key not in a or key not in b or va != vb:
            out.append(dotted)
    return out


def missing_paths(cfg: WsiTrainConfig) -> list[str]:
    """``key: problem`` for every file or folder the config names that is not there (what ``validate`` checks)."""
    problems = []
    d, weights = cfg.data, cfg.model.weights
    if d.labels is not None and not d.labels.is_file():
        what = "is a folder, not a CSV file" if d.labels.is_dir() else "file not found"
        problems.append(f"data.labels: {d.labels}: {what} ({d.labels.resolve()})")
    if d.slides_dir is not None and not d.slides_dir.is_dir():
        what = "is a file, not a folder" if d.slides_dir.exists() else "folder not found"
        problems.append(f"data.slides_dir: {d.slides_dir}: {what} ({d.slides_dir.resolve()})")
    if weights is not None and not is_imagenet(weights) and not weights.is_file():
        what = "is a folder, not a weights file" if weights.is_dir() else "file not found"
        problems.append(f"model.weights: {weights}: {what} ({weights.resolve()})")
    return problems


def config_summary(cfg: WsiTrainConfig) -> dict[str, str]:
    """A few lines that say what a config will do, for ``wsitrain validate``."""
    d, e, t = cfg.data, cfg.engine, cfg.train
    if d.synthetic is not None:
        source = f"{d.synthetic.n} synthetic slides of {d.synthetic.size} px (cache {d.synthetic.cache_dir})"
    elif d.labels is not None:
        source = f"labels {d.labels}" + (f", slides in {d.slides_dir}" if d.slides_dir else "")
    else:
        source = "none set (set data.labels or data.synthetic before `wsitrain fit`)"
    scale = (
        f"level {d.level}"
        if d.level is not None
        else f"{d.mpp} µm/px"
        if d.mpp is not None
        else f"{d.magnification}x"
        if d.magnification is not None
        else "level 0"
    )
    budget = format_bytes(e.memory_budget_bytes) if e.memory_budget is not None else "detected from the device"
    tk = cfg.task
    task = {} if tk.kind == "classification" else {"task": tk.kind + (
        f" (columns {', '.join(tk.columns or [])}" + (f", loss {tk.loss})" if tk.kind == "regression" else ")")
        if tk.columns else f" (time {tk.time}, event {tk.event}, {tk.bins} bins)")}  # fmt: skip
    return {
        **task,
        "model": f"{cfg.model.name} (pool {cfg.model.pool}, "
        + (f"classes {cfg.model.num_classes or 'from labels'})" if not task else "head from the task)"),
        "data": source,
        "read": f"{scale}, region {d.region}" + (f" {d.size}" if d.size is not None else ""),
        "engine": f"budget {budget}, tile {e.tile_size or 'planned'}, device {e.device}",
        "train": f"{t.epochs} epochs, {t.optimizer} lr {t.lr:g} ({t.schedule}), {t.precision}, loss {t.loss}",
        "log": f"{cfg.log.dir} (tiles: {cfg.log.tiles})",
    }
