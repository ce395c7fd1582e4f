"""The ``wsitrain`` command line: parse options, call the module that does the work, print its errors.

Kept thin on purpose: each command imports its module lazily, so ``wsitrain --help`` does not load torch and a
module that is missing or broken only breaks its own command.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from wsitrain import __version__, log
from wsitrain.errors import ConfigError, NotAvailableError, WsiTrainError
from wsitrain.models.registry import BUILTIN_NAMES

if TYPE_CHECKING:
    from wsitrain.config import WsiTrainConfig

GLOBAL_FLAGS = ("--quiet", "-q", "--verbose", "-v")


def hoist_global_options(args: list[str]) -> list[str]:
    """Move --quiet/--verbose given after the command (`wsitrain fit --quiet CONFIG`, natural in job scripts) before
    it, where the app callback reads them. Nothing after `--` moves; no command uses -q or -v for anything else."""
    args = list(args)
    end = args.index("--") if "--" in args else len(args)
    first = next((i for i, a in enumerate(args[:end]) if not a.startswith("-")), None)
    if first is None:
        return args
    moved = [a for a in args[first + 1 : end] if a in GLOBAL_FLAGS]
    rest = [a for a in args[first + 1 : end] if a not in GLOBAL_FLAGS]
    return args[:first] + moved + [args[first]] + rest + args[end:]


class _Group(TyperGroup):
    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_global_options(args))


app = typer.Typer(
    name="wsitrain",
    cls=_Group,
    help="Train CNNs end-to-end on whole-slide images with slide-level labels, with exact tiled (SFT) execution.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # errors are printed by _handled below, tracebacks only with --verbose
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Set by the app callback before any command runs.
_state: dict[str, Any] = {"quiet": False, "verbose": False, "console": None}

F = TypeVar("F", bound=Callable[..., Any])

SHAPES_ONLY_HELP = "Preflight: plan whole slides, skipping tissue detection (faster on thousands of slides)."
MODEL_HELP = f"Model: a built-in ({', '.join(BUILTIN_NAMES)}), torchvision/<name> or timm/<name>."
CONFIG_HELP = "YAML config file (see configs/ and docs/reference/config.md)."
SET_HELP = "Override a config key, e.g. --set train.lr=1e-4 --set data.level=1 (repeatable; values are YAML)."


def _console() -> Console:
    if _state["console"] is None:
        _state["console"] = log.make_console(_state["quiet"], _state["verbose"])
    return _state["console"]


def _handled(fn: F) -> F:
    """Print a WsiTrainError as `error:` + `hint:` and exit with its code; anything else is an internal error."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.BadParameter):
            raise
        except WsiTrainError as err:
            if _state["verbose"] and err.__cause__ is not None:  # an internal error chained: show where it was
                log.traceback()
            if err.notice and os.environ.get("RANK", "0") != "0":
                raise typer.Exit(err.exit_code) from None  # an expected stop (preempted) is said once, by rank 0
            (log.notice if err.notice else log.error)(err.message, err.hint)
            raise typer.Exit(err.exit_code) from None
        except Exception as err:
            log.internal_error(err, verbose=_state["verbose"])
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _entry(module: str, attr: str, command: str) -> Callable[..., Any]:
    """Import ``module.attr`` for ``wsitrain command``; a missing wsitrain module means the command is not built yet."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or "?"
        if missing == "wsitrain" or missing.startswith("wsitrain."):
            raise NotAvailableError(
                f"`wsitrain {command}` is not available yet: module {missing} is missing from this installation",
                hint="update wsitrain (git pull && pip install -e .); the other commands work without it",
            ) from e
        raise WsiTrainError(
            f"`wsitrain {command}` needs the Python package {missing!r}, which is not installed",
            hint="reinstall the dependencies: pip install -e . (or `make test`, which creates .venv)",
        ) from e
    fn = getattr(mod, attr, None)
    if fn is None:
        raise NotAvailableError(
            f"`wsitrain {command}` is not available yet: {module}.{attr} does not exist",
            hint="update wsitrain (git pull && pip install -e .)",
        )
    return fn


def _load_config(config: Path, overrides: list[str] | None) -> WsiTrainConfig:
    from wsitrain.config import load_config  # lazy: pydantic and yaml cost import time

    return load_config(config, overrides or [])


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"wsitrain {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only warnings and errors."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print debug messages and full tracebacks."),
) -> None:
    """Train CNNs end-to-end on whole-slide images with slide-level labels.

    The SFT engine tiles each slide so it fits your GPU and still gives exactly the gradients of plain PyTorch.
    Start with `wsitrain fit configs/demo.yaml`; every config key: docs/reference/config.md.
    """
    _state.update(quiet=quiet, verbose=verbose, console=None)


@app.command()
@_handled
def fit(
    config: Path = typer.Argument(..., metavar="CONFIG", help=CONFIG_HELP),
    set_: list[str] | None = typer.Option(None, "--set", "-s", metavar="KEY=VALUE", help=SET_HELP),
    resume: Path | None = typer.Option(
        None, "--resume", metavar="RUN_DIR",
        help="Continue the run in this folder from its last checkpoint; `auto`: the run this Slurm job started "
        "(after a requeue), else a new run.",
    ),
    force: bool = typer.Option(False, "--force", help="With --resume: continue even if the config has changed."),
    name: str | None = typer.Option(
        None,
        "--name",
        help="Run folder name under log.dir, one plain folder name (default: config key `name`, else run-DATE-TIME).",
    ),
    shapes_only: bool = typer.Option(False, "--shapes-only", help=SHAPES_ONLY_HELP),
) -> None:
    """Train a slide-level classifier on whole slides.

    Writes a new run folder (config, metrics, checkpoints); an existing folder is never overwritten.

    Examples:

      wsitrain fit configs/demo.yaml

      wsitrain fit my.yaml --set train.lr=1e-4 --set train.epochs=20 --name lr-1e-4

      wsitrain fit my.yaml --resume runs/lr-1e-4
    """
    cfg = _load_config(config, set_)
    run_fit = _entry("wsitrain.train.fit", "run_fit", "fit")
    # --quiet keeps fit's epoch summaries: the console stays on and the fit itself prints only those (brief)
    console = log.make_console(_state["quiet"], _state["verbose"], summaries=True)
    run_fit(cfg, resume=resume, force=force, name=name, console=console, quiet=_state["quiet"],
            brief=_state["quiet"], shapes_only=shapes_only)  # fmt: skip


@app.command()
@_handled
def cv(
    config: Path = typer.Argument(..., metavar="CONFIG", help=CONFIG_HELP),
    folds: int = typer.Option(5, "--folds", min=2, help="Number of folds (K)."),
    set_: list[str] | None = typer.Option(None, "--set", "-s", metavar="KEY=VALUE", help=SET_HELP),
    name: str | None = typer.Option(None, "--name", help="Folder name under log.dir [NAME-cvK from the config]."),
) -> None:
    """Cross-validate: K fits on folds grouped by patient and stratified by label; rerunning resumes.

    Writes log.dir/NAME-cvK with fold-1 ... fold-K run folders, cv_summary.json and cv.html.

    Example:

      wsitrain cv configs/demo.yaml --folds 3
    """
    cfg = _load_config(config, set_)
    run_cv = _entry("wsitrain.train.cv", "run_cv", "cv")
    run_cv(cfg, folds=folds, name=name, console=_console(), quiet=_state["quiet"])


@app.command()
@_handled
def predict(
    config: Path = typer.Argument(..., metavar="CONFIG", help="The YAML config the model was trained with."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Checkpoint file, e.g. runs/NAME/best.pt."),
    slides: Path = typer.Option(..., "--slides", help="Folder of slides to predict (every slide file in it)."),
    out: Path = typer.Option(..., "--out", help="CSV to write: one row per slide with class probabilities."),
    set_: list[str] | None = typer.Option(None, "--set", "-s", metavar="KEY=VALUE", help=SET_HELP),
    heatmaps: Path | None = typer.Option(
        None, "--heatmaps", help="Folder for per-slide class activation maps (.npy and .png over the thumbnail)."
    ),
    saliency: bool = typer.Option(False, "--saliency", help="With --heatmaps: add the exact input-gradient map."),
    viewer_files: bool = typer.Option(
        True, "--viewer-files/--no-viewer-files",
        help="With --heatmaps: also write NAME.geojson (QuPath detections) and NAME.heatmap.tif (slide-sized TIFF).",
    ),
    geojson_cell: int | None = typer.Option(
        None, "--geojson-cell", min=1, metavar="K",
        help="GeoJSON detections of K x K map cells (default: the smallest K leaving at most 150,000 detections).",
    ),
    patients: Path | None = typer.Option(
        None, "--patients", help="CSV with slide and patient columns: also write OUT.patients.csv (mean per patient)."
    ),
) -> None:
    """Predict slide-level class probabilities (or a task's outputs) with a trained checkpoint.

    Example:

      wsitrain predict configs/demo.yaml --checkpoint runs/demo/best.pt --slides new-slides/ --out preds.csv
    """
    if saliency and heatmaps is None:
        raise typer.BadParameter("--saliency needs --heatmaps DIR (the folder the maps are written to)")
    cfg = _load_config(config, set_)
    run_predict = _entry("wsitrain.train.predict", "run_predict", "predict")
    run_predict(cfg, checkpoint=checkpoint, slides=slides, out=out, console=_console(), heatmaps=heatmaps,
                saliency=saliency, viewer_files=viewer_files, geojson_cell=geojson_cell, patients=patients)


@app.command()
@_handled
def report(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A run folder written by fit, e.g. runs/demo."),
    heatmaps: bool = typer.Option(
        True, "--heatmaps/--no-heatmaps", help="Compute validation heatmaps when RUN_DIR/heatmaps has none."
    ),
) -> None:
    """Write RUN_DIR/report.html: one self-contained page (curves, plan, tile stats, validation slides, heatmaps).

    Example:

      wsitrain report runs/demo
    """
    write_report = _entry("wsitrain.report.html", "write_report", "report")
    path = write_report(run_dir, heatmaps=heatmaps, console=_console())
    typer.echo(str(path))  # the result itself: printed even with --quiet


@app.command()
@_handled
def plan(
    model: str | None = typer.Option(None, "--model", help=MODEL_HELP + " Not with --config."),
    size: str | None = typer.Option(
        None, "--size", help="Input edge in pixels (20480) or HxW (20480x10240); with --config, data.size by default."
    ),
    gpu: str | None = typer.Option(None, "--gpu", help="Plan for a known card, e.g. 2080ti, v100, a100, h100."),
    memory: str | None = typer.Option(None, "--memory", help="Plan for this memory budget instead, e.g. 24GiB."),
    batch: int = typer.Option(1, "--batch", min=1, help="Images per step."),
    input_dtype: str = typer.Option(
        "uint8", "--input-dtype", help="The image as the engine gets it: uint8 (slides, as fit reads them) or float32 "
        "(a float tensor, as a library user may pass). On CPU the image is inside the budget; on a GPU in host memory."
    ),
    precision: str | None = typer.Option(
        None, "--precision", help="Activation precision: fp32 (the default), bf16 or fp16; with --config, "
        "train.precision by default."
    ),
    tile: int | None = typer.Option(None, "--tile", min=1, help="Force this tile edge in input pixels."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    simulate: bool = typer.Option(
        False, "--simulate", help="Also run one training step of the real executor on a simulated GPU (fake tensors)."
    ),
    every_tile: bool = typer.Option(
        False, "--every-tile", help="With --simulate: visit every tile, not only one of each kind (same peaks, slower)."
    ),
    tissue: float | None = typer.Option(
        None, "--tissue", min=0.0, max=1.0, help="Also predict the step time when this share of the tiles (of the "
        "patches, for a patch encoder) holds tissue (masked background computed once), e.g. 0.4.",
    ),
    pool: str | None = typer.Option(
        None, "--pool", help="The head's pooling: avg (the default), max, attention, gated_attention or topk."
    ),
    map_norm: str | None = typer.Option(None, "--map-norm", help="model.map_norm: slide standardises the trunk's map "
                                        "over the slide before the head (none, the default: as it is)."),
    config: Path | None = typer.Option(
        None, "--config", help="Plan a run's config: its model section as fit builds it (attention keys, map_norm, "
        "freeze, freeze_bn), with its precision, optimizer, engine budget and tile size unless given here.",
    ),
    freeze: str | None = typer.Option(
        None, "--freeze", help="Plan fine-tuning with layers frozen (model.freeze): up to a module (layer2) or a list "
        "(conv1,layer1); shows the saving against nothing frozen.",
    ),
    host_memory: str | None = typer.Option(
        None, "--host-memory", help="Host RAM per rank for host checkpoints and the image (engine.host_memory), e.g. "
        "16GiB; what it does not hold spills to disk. Default: this node's RAM over its ranks.",
    ),
    max_size: bool = typer.Option(
        True, "--max-size/--no-max-size", help="Also search the largest square image that fits (plans about 16 "
        "sizes: a minute more for EfficientNet-class models).",
    ),
    fold_bn: bool | None = typer.Option(
        None, "--fold-bn/--no-fold-bn", help="engine.fold_bn: fold frozen BatchNorm into the convolution before it "
        "(default: on, or the config's); --no-fold-bn plans and simulates every BatchNorm as itself, for comparison.",
    ),
) -> None:
    """Show how the SFT engine would tile a model for an image size and memory budget (allocates nothing).

    Exits 0 when the plan fits the budget, non-zero when it does not.

    Examples:

      wsitrain plan --model vgg16 --size 20480 --gpu 2080ti

      wsitrain plan --model resnet50 --size 40000 --memory 80GiB --precision bf16 --json

      wsitrain plan --model vgg16 --size 20480 --gpu 2080ti --simulate

      wsitrain plan --model resnet50 --size 40000 --gpu a100-80 --tissue 0.4

      wsitrain plan --model resnet50 --size 100000 --gpu 2080ti --pool gated_attention

      wsitrain plan --model resnet50 --size 8192 --gpu 2080ti --freeze layer2

      wsitrain plan --model resnet50 --size 200000 --gpu rtx3090 --host-memory 16GiB

      wsitrain plan --config configs/demo.yaml --size 8192 --gpu 2080ti
    """
    run_plan = _entry("wsitrain.plan.command", "run_plan", "plan")
    code = run_plan(
        model=model,
        size=size,
        gpu=gpu,
        memory=memory,
        batch=batch,
        precision=precision,
        tile=tile,
        as_json=as_json,
        console=_console(),
        simulate=simulate,
        every_tile=every_tile,
        tissue=tissue,
        pool=pool,
        map_norm=map_norm,
        freeze=freeze,
        host_memory=host_memory,
        with_max_size=max_size,
        config=config,
        fold_bn=fold_bn,
        input_dtype=input_dtype,
    )
    if code:
        raise typer.Exit(int(code))


@app.command()
@_handled
def bench(
    gpu: str | None = typer.Option(None, "--gpu", help="Emulate a known card's memory, e.g. 2080ti."),
    model: str | None = typer.Option(
        None, "--model", help=f"Built-in model: {', '.join(BUILTIN_NAMES)} [default: vgg16]."
    ),
    sizes: str | None = typer.Option(
        None,
        "--sizes",
        help="Comma-separated image edges in pixels [default: 128,256,512 on CPU (a few minutes); "
        "1024 to 16384 on a GPU].",
    ),
    strategies: str = typer.Option(
        "base,checkpoint,sft", "--strategies", help="Comma-separated: base (plain), checkpoint, sft."
    ),
    runs: int | None = typer.Option(
        None, "--runs", min=1, help="Timed steps per configuration after one warm-up [default: 2 on CPU, 5 on GPU]."
    ),
    out: Path | None = typer.Option(None, "--out", help="Output folder for bench.csv/json/png."),
    memory: str | None = typer.Option(None, "--memory", help="Memory budget, e.g. 11GiB (default: the device's)."),
    precision: str = typer.Option("fp32", "--precision", help="fp32, bf16 or fp16."),
) -> None:
    """Time training steps of plain PyTorch, checkpointing and SFT across image sizes; mark out-of-memory.

    Examples:

      wsitrain bench --model tiny --sizes 256,512 --runs 2

      wsitrain bench --gpu 2080ti --model vgg16 --sizes 2048,4096,8192,16384 --out bench-out/
    """
    run_bench = _entry("wsitrain.bench", "run_bench", "bench")
    run_bench(
        gpu=gpu,
        model=model,
        sizes=sizes,
        strategies=strategies,
        runs=runs,
        out=out,
        memory=memory,
        precision=precision,
        console=_console(),
    )


@app.command("check-model")
@_handled
def check_model(
    name: str = typer.Argument(
        ..., metavar="NAME", help="tiny, resnet18, torchvision/<name>, timm/<name>, or module:function / file.py:fn."
    ),
    size: str = typer.Option("128x160", "--size", help="Image edge (128) or HxW; non-square shows a swapped axis."),
    batch: int = typer.Option(2, "--batch", min=1, help="Images per step."),
    train_bn: bool = typer.Option(False, "--train-bn", help="BatchNorm in train mode (batch statistics)."),
    tile: int | None = typer.Option(None, "--tile", min=1, help="Forced tile edge [a quarter of the shorter edge]."),
    tol: float = typer.Option(
        1e-12, "--tol", help="Largest relative error still called exact (or 100x plain's own rounding noise if larger)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Check that the SFT engine trains a model exactly: one float64 step, plain PyTorch against SFT.

    Random weights (seeded), under forced small tiles and under the planner's own plan at 45% of plain's activation
    memory. Each check prints exact (worst relative error), refused (the layer and why) or wrong (which gradients).
    Exits 0 when every check is exact or refused, 1 when one is wrong.

    Examples:

      wsitrain check-model timm/resnet18

      wsitrain check-model my_models.py:build_net --size 256x320 --train-bn --json
    """
    run = _entry("wsitrain.check.run", "run_check_model", "check-model")
    code = run(name, size, batch, train_bn, tile, tol, as_json)
    if code:
        raise typer.Exit(int(code))


@app.command()
@_handled
def doctor(
    out: Path | None = typer.Option(None, "--out", help="Folder for doctor.md and doctor.json [doctor-out/TIME]."),
    fast: bool = typer.Option(False, "--fast", help="Small models and sizes: a few seconds to a minute."),
    calibrate: bool | None = typer.Option(
        None, "--calibrate/--no-calibrate", help="Fit the time model on this device [default: on a GPU only]."
    ),
    figure8: bool = typer.Option(False, "--figure8", help="Also run the SFT paper's Figure 8 benchmark (long)."),
    cap: str | None = typer.Option(None, "--cap", help="Memory cap of the peak checks [11GiB; 1GiB with --fast]."),
    cpu: bool = typer.Option(False, "--cpu", help="Check the CPU path even where a GPU is present."),
) -> None:
    """Check wsitrain on this machine's GPU and write one report to paste into an issue.

    Runs exactness on the device, a training step's peak under a memory cap against its plan, the cuBLAS/cuDNN
    workspaces, and calibrates the planner's time model for this GPU (used by plan and fit from then on).
    Without a GPU it runs the CPU checks and says which GPU checks it could not run. Exits 1 when a check fails.

    Examples:

      wsitrain doctor

      wsitrain doctor --fast --out doctor-report
    """
    run_doctor = _entry("wsitrain.doctor", "run_doctor", "doctor")
    code = run_doctor(out=out, fast=fast, calibrate_time=calibrate, figure8=figure8, cap=cap, cpu=cpu,
                      console=_console())  # fmt: skip
    if code:
        raise typer.Exit(int(code))


@app.command()
@_handled
def synth(
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="Folder to write the slides and labels.csv into."),
    n: int = typer.Option(8, "--n", min=1, help="Number of slides."),
    size: int = typer.Option(4096, "--size", min=64, help="Slide edge in pixels."),
    seed: int = typer.Option(0, "--seed", help="Random seed (same seed, same slides)."),
    positive_fraction: float = typer.Option(
        0.5, "--positive-fraction", min=0.0, max=1.0, help="Fraction of slides labelled positive."
    ),
    task: str = typer.Option(
        "classification", "--task", help="classification, or regression / survival / multilabel: targets that "
        "depend on what the slides show (columns score; time, event; purple, brown, teal; and patient).",
    ),
    test_fraction: float = typer.Option(
        0.0, "--test-fraction", min=0.0, max=0.9, help="With --task: patients marked split=test (and a quarter of "
        "the rest val).",
    ),
    lesions: str = typer.Option(
        "none", "--lesions", metavar="[none|small|paired]",
        help="small: 1-3 small lesions per positive slide and look-alike distractors, at 2.5 um/px (lesions.json); "
        "paired: the same with a look-alike on every slide of either class.",
    ),  # fmt: skip
) -> None:
    """Write a synthetic labelled dataset of pyramidal SVS slides (for demos and tests).

    Examples:

      wsitrain synth data/synthetic --n 24 --size 2048
      wsitrain synth data/lesions --n 48 --size 2048 --lesions small

      wsitrain synth data/survival --task survival --n 48 --size 1024 --test-fraction 0.25
    """
    # through _entry: an installation without the synthetic slides says so (exit 3), whatever was imported before
    modes = _entry("wsitrain.slides.synth.lesions", "LESION_MODES", "synth")
    if lesions not in modes:
        raise typer.BadParameter(f"{lesions!r} is not one of {', '.join(modes)}", param_hint="'--lesions'")
    if lesions != "none" and task != "classification":
        raise typer.BadParameter(f"--lesions {lesions} makes classification slides; leave out --task",
                                 param_hint="'--lesions'")
    if task != "classification":
        write_task = _entry("wsitrain.slides.synth.targets", "write_task_dataset", "synth")
        csv_path = write_task(out_dir, task, n=n, size=size, seed=seed, test_fraction=test_fraction)
        _console().print(f"wrote {n} slides for task {task}; labels: {csv_path}", soft_wrap=True)
        return
    write = _entry("wsitrain.slides.synth", "write_synthetic_dataset", "synth")
    extra = {"lesions": lesions} if lesions != "none" else {}  # the default call stays as it was
    csv_path = write(out_dir, n=n, size=size, seed=seed, positive_fraction=positive_fraction, **extra)
    _console().print(f"wrote {n} slides; labels: {csv_path}", soft_wrap=True)


@app.command()
@_handled
def validate(
    config: Path = typer.Argument(..., metavar="CONFIG", help="YAML config file to check."),
    set_: list[str] | None = typer.Option(None, "--set", "-s", metavar="KEY=VALUE", help=SET_HELP),
    shapes_only: bool = typer.Option(False, "--shapes-only", help=SHAPES_ONLY_HELP),
) -> None:
    """Check a config file (and overrides) and that the files it names exist, without running anything; list every
    problem found.

    Example:

      wsitrain validate configs/demo.yaml --set train.lr=1e-4
    """
    from wsitrain.config import config_summary, missing_paths

    cfg = _load_config(config, set_)
    problems = missing_paths(cfg)
    if problems:
        raise ConfigError(problems, source=str(config))
    console = _console()
    report = _entry("wsitrain.preflight", "check_run", "validate")(cfg, shapes_only=shapes_only, console=console)
    console.print(f"[green]{config} is valid[/]", soft_wrap=True)
    table = Table(show_header=False, box=None, pad_edge=False)
    for key, value in config_summary(cfg).items():
        table.add_row(f"[bold]{key}[/]", value)
    console.print(table)
    if report is not None:
        console.print(report.table())
        pieces = report.tissue_table()
        if pieces is not None:
            console.print(pieces)


@app.command()
@_handled
def models(
    name: str | None = typer.Argument(None, metavar="[NAME]", help="Describe one model, e.g. torchvision/resnet50."),
) -> None:
    """List the built-in models and how to name any torchvision or timm CNN; with NAME, describe that model.

    Examples:

      wsitrain models

      wsitrain models torchvision/efficientnet_b0
    """
    from wsitrain.models.listing import print_models

    print_models(_console(), name)


@app.command()
@_handled
def info(
    slide: Path = typer.Argument(..., metavar="SLIDE", help="Slide file (SVS, NDPI, MRXS, TIFF, ...)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Show a slide's vendor, reader, dimensions, pyramid levels, mpp, objective power and associated images.

    Examples:

      wsitrain info slides/CMU-1.svs

      wsitrain info slides/CMU-1.svs --json
    """
    slide_info = _entry("wsitrain.slides.info", "slide_info", "info")
    facts = slide_info(slide).to_dict()
    if as_json:
        typer.echo(json.dumps(facts, indent=2))  # the result itself: printed even with --quiet
        return
    _console().print(_slide_table(facts))


def _slide_table(facts: dict[str, Any]) -> Table:
    table = Table(title=str(facts.get("path", "")), show_header=False, title_justify="left")
    mpp = facts.get("mpp")
    dims = facts.get("dimensions") or []
    rows = {
        "vendor": facts.get("vendor") or "unknown",
        "reader": facts.get("reader"),
        "dimensions": " x ".join(map(str, dims)) + " px (width x height)" if dims else "-",
        "mpp": f"{mpp[0]:.4g} x {mpp[1]:.4g} µm/px" if mpp else "not in the metadata",
        "objective power": f"{facts['objective_power']:g}x" if facts.get("objective_power") else "not in the metadata",
        "associated images": ", ".join(facts.get("associated_images") or []) or "none",
    }
    for key, value in rows.items():
        table.add_row(f"[bold]{key}[/]", str(value))
    levels = zip(facts.get("level_dimensions") or [], facts.get("level_downsamples") or [], strict=False)
    for i, (level_dims, down) in enumerate(levels):
        table.add_row(f"[bold]level {i}[/]", f"{level_dims[0]} x {level_dims[1]} px, downsample {down:g}")
    return table


def main() -> None:
    """Console-script entry point (``wsitrain``)."""
    try:
        app(prog_name="wsitrain")
    except WsiTrainError as err:  # raised outside a command (e.g. while parsing); commands handle their own
        log.error(err.message, err.hint)
        raise SystemExit(err.exit_code) from None


if __name__ == "__main__":
    main()
