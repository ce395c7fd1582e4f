"""Config loading: every example config validates, overrides work, and every mistake is reported with its key."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from wsitrain.config import (
    WsiTrainConfig,
    config_summary,
    config_to_dict,
    diff_configs,
    load_config,
)
from wsitrain.errors import ConfigError, WsiTrainError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def problems_of(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value.problems


def test_configs_folder_is_not_empty() -> None:
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "vgg16-20480-2080ti.yaml", "resnet50-cluster.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_validates(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, WsiTrainConfig)
    assert cfg.source == path


def test_demo_config_values(repo_root: Path) -> None:
    cfg = load_config(repo_root / "configs" / "demo.yaml")
    assert cfg.model.name == "tiny"
    assert cfg.data.synthetic is not None and cfg.data.synthetic.n == 24 and cfg.data.synthetic.size == 1024
    assert cfg.data.region == "whole"
    assert cfg.engine.memory_budget_bytes is not None and cfg.engine.memory_budget_bytes < 1024**3
    assert cfg.engine.tile_size == 256


def test_example_configs_match_their_names(repo_root: Path) -> None:
    vgg = load_config(repo_root / "configs" / "vgg16-20480-2080ti.yaml")
    assert (vgg.model.name, vgg.data.region, vgg.data.size, vgg.data.mpp) == ("vgg16", "fixed", 20480, 0.5)
    assert vgg.engine.memory_budget_bytes == 11 * 1024**3
    resnet = load_config(repo_root / "configs" / "resnet50-cluster.yaml")
    assert (resnet.model.name, resnet.train.precision, resnet.distributed.backend) == ("resnet50", "bf16", "nccl")
    assert (resnet.data.mpp, resnet.data.region) == (1.0, "tissue")


def test_empty_file_gives_documented_defaults(write_yaml) -> None:
    cfg = load_config(write_yaml(""))
    assert cfg.model.name == "tiny" and cfg.train.lr == 1e-3 and cfg.train.optimizer == "adamw"
    assert cfg.data.region == "tissue" and cfg.data.background == (255, 255, 255) and cfg.data.level is None
    assert cfg.log.dir == Path("runs") and cfg.distributed.bucket_mb == 25.0
    assert cfg.engine.memory_budget_bytes is None


def test_overrides_set_numbers_and_create_sections(write_yaml) -> None:
    cfg = load_config(write_yaml("train: {lr: 0.1}\n"), ["train.lr=1e-4", "data.level=1", "data.synthetic.n=4"])
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.data.level == 1
    assert cfg.data.synthetic is not None and cfg.data.synthetic.n == 4


def test_overrides_parse_yaml_values(write_yaml) -> None:
    cfg = load_config(
        write_yaml(""),
        [
            "data.prefetch=false",
            "data.size=[512, 256]",
            "data.region=fixed",
            "name=2024",
            "log.dir=2024",
            "engine.memory_budget=2GiB",
        ],
    )
    assert cfg.data.prefetch is False
    assert cfg.data.size == (512, 256)
    assert cfg.name == "2024"  # a text key keeps what was typed, not the number 2024
    assert cfg.log.dir == Path("2024")  # likewise a path key
    assert cfg.engine.memory_budget_bytes == 2 * 1024**3


def test_unknown_override_key_lists_valid_keys(write_yaml) -> None:
    (problem,) = problems_of(write_yaml(""), ("train.learning_rate=1",))
    assert "train.learning_rate" in problem
    assert "valid keys here" in problem and "lr" in problem and "epochs" in problem


def test_override_without_equals_and_into_a_value(write_yaml) -> None:
    problems = problems_of(write_yaml(""), ("train.lr", "train.lr.x=1"))
    assert len(problems) == 2
    assert "KEY=VALUE" in problems[0]
    assert "'train.lr' is a value, not a section" in problems[1]


def test_error_messages_name_key_and_fix(write_yaml) -> None:
    path = write_yaml(
        "model: {name: vgg61}\n"
        "train: {lr: fast, epochs: 0}\n"
        "data: {foo: 1, background: [1, x, 3]}\n"
        "engine: {memory_budget: lots}\n"
    )
    problems = problems_of(path)
    model_problem = next(p for p in problems if p.startswith("model.name"))
    assert model_problem.startswith(
        "model.name: 'vgg61' is not a valid choice; choose one of tiny, tiny_bn, tiny_ln, vgg16, vgg19, darknet19, "
        "resnet18, resnet34, resnet50, or torchvision/<name>"
    )
    assert "train.lr: expected a number, got 'fast'" in problems
    assert "train.epochs: must be >= 1, got 0" in problems
    assert "data.background[1]: expected a whole number, got 'x'" in problems
    assert any(p.startswith("engine.memory_budget: cannot read 'lots' as a size") for p in problems)
    unknown = next(p for p in problems if p.startswith("data.foo"))
    assert unknown.startswith("data.foo: unknown key; valid keys here: labels, slides_dir, synthetic")
    assert len(problems) == 6  # every mistake, each once


def test_union_field_reports_once_with_the_useful_branch(write_yaml) -> None:
    path = write_yaml("")
    assert problems_of(path, ("data.size=abc",)) == ["data.size: expected a whole number or a list, got 'abc'"]
    assert problems_of(path, ("data.size=-5",)) == ["data.size: must be > 0, got -5"]
    assert problems_of(path, ("data.size=[5, x]",)) == ["data.size[1]: expected a whole number, got 'x'"]
    assert problems_of(path, ("data.size=[1, 2, 3]",)) == ["data.size: expected at most 2 items, got [1, 2, 3]"]


def test_error_is_one_config_error_naming_the_file(write_yaml) -> None:
    path = write_yaml("model: {name: nope}\n", name="mine.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in info.value.message and info.value.exit_code == 2
    assert "validate" in (info.value.hint or "")


def test_region_fixed_requires_size(write_yaml) -> None:
    (problem,) = problems_of(write_yaml("data: {region: fixed}\n"))
    assert problem.startswith("data: region is 'fixed' but size is not set")
    assert load_config(write_yaml("data: {region: fixed, size: 2048}\n")).data.size == 2048


def test_only_one_of_level_mpp_magnification(write_yaml) -> None:
    (problem,) = problems_of(write_yaml("data: {level: 1, mpp: 0.5}\n"))
    assert "level and mpp are both set" in problem and "exactly one of level, mpp, magnification" in problem
    assert load_config(write_yaml("data: {magnification: 20}\n")).data.magnification == 20.0


def test_labels_and_synthetic_are_exclusive(write_yaml) -> None:
    (problem,) = problems_of(write_yaml("data: {labels: a.csv, synthetic: {n: 4}}\n"))
    assert "labels and synthetic are both set" in problem


def test_bare_off_in_yaml_means_the_choice_off(write_yaml) -> None:
    # YAML 1.1 reads `off` as false; log.tiles: off must still mean "off".
    assert load_config(write_yaml("log: {tiles: off}\n")).log.tiles == "off"


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    (problem,) = problems_of(path)
    assert "file not found" in problem and str(path.resolve()) in problem


def test_yaml_syntax_error_names_line(write_yaml) -> None:
    (problem,) = problems_of(write_yaml("model:\n  name: tiny\n  pool: [avg\n"))
    assert problem.startswith("YAML syntax error at line ")


def test_duplicate_key_is_an_error(write_yaml) -> None:
    (problem,) = problems_of(write_yaml("train:\n  lr: 0.1\n  lr: 0.2\n"))
    assert "duplicate key 'lr'" in problem and "line 3" in problem


def test_top_level_must_be_a_mapping(write_yaml) -> None:
    (problem,) = problems_of(write_yaml("- a\n- b\n"))
    assert "mapping of sections" in problem


def test_section_must_be_a_mapping(write_yaml) -> None:
    (problem,) = problems_of(write_yaml("train: 5\n"))
    assert problem == "train: expected a section of keys (a YAML mapping), got 5"


def test_config_to_dict_round_trips(write_yaml, tmp_path: Path) -> None:
    import yaml

    cfg = load_config(write_yaml("data: {region: fixed, size: [64, 32]}\nengine: {memory_budget: 1GiB}\n"))
    d = config_to_dict(cfg)
    assert d["data"]["size"] == [64, 32] and d["log"]["dir"] == "runs"
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(d))
    assert config_to_dict(load_config(again)) == d


def test_diff_configs_lists_dotted_keys() -> None:
    a = config_to_dict(WsiTrainConfig())
    b = config_to_dict(WsiTrainConfig.model_validate({"train": {"lr": 0.5}, "data": {"augment": {"flips": False}}}))
    assert diff_configs(a, a) == []
    assert diff_configs(a, b) == ["data.augment.flips", "train.lr"]
    assert diff_configs({"x": 1}, {"y": 1}) == ["x", "y"]
    assert diff_configs({"s": {"k": 1}}, {"s": None}) == ["s"]


def test_summary_mentions_missing_data_source() -> None:
    summary = config_summary(WsiTrainConfig())
    assert "none set" in summary["data"]
    assert summary["model"].startswith("tiny")


def test_size_only_with_fixed_region_and_bounded_jitter(write_yaml) -> None:
    (size_problem,) = problems_of(write_yaml("data: {region: tissue, size: 2048}\n"))
    assert "size is set but region is 'tissue'" in size_problem
    (jitter_problem,) = problems_of(write_yaml("data: {augment: {jitter_strength: 3}}\n"))
    assert jitter_problem.startswith("data.augment.jitter_strength")


def test_one_precision_vocabulary() -> None:
    import torch

    from wsitrain.config import TrainConfig
    from wsitrain.precision import PRECISIONS, activation_dtype, autocast_dtype, check_precision

    assert PRECISIONS == ("fp32", "bf16", "fp16")
    assert [activation_dtype(p) for p in PRECISIONS] == [torch.float32, torch.bfloat16, torch.float16]
    assert [autocast_dtype(p) for p in PRECISIONS] == [None, torch.bfloat16, torch.float16]
    assert TrainConfig(precision="bf16").precision == "bf16"
    with pytest.raises(WsiTrainError, match="--precision: unknown precision 'fp8'") as err:
        check_precision("fp8")
    assert all(p in err.value.hint for p in PRECISIONS)


@pytest.mark.parametrize(
    ("key", "value"),
    [("train.epochs", "true"), ("train.lr", "false"), ("data.level", "true"), ("data.background", "[255, true, 0]"),
     ("engine.memory_budget", "true"), ("seed", "true")],
)  # fmt: skip
def test_booleans_are_not_numbers(write_yaml, key: str, value: str) -> None:
    path = write_yaml("{}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, [f"{key}={value}"])
    assert f"{key}: expected a number" in err.value.message and "true/false is not a number" in err.value.message


@pytest.mark.parametrize("name", ["..", ".", "../../x", "a/b", ".hidden"])
def test_run_names_stay_inside_log_dir(name: str) -> None:
    with pytest.raises(ValidationError, match="log.dir"):
        WsiTrainConfig.model_validate({"name": name})
    assert WsiTrainConfig.model_validate({"name": "lr-1e-4.v2"}).name == "lr-1e-4.v2"


def test_read_threads_is_a_positive_int_or_auto(write_yaml) -> None:
    path = write_yaml("")
    assert load_config(path).data.read_threads == "auto"
    assert load_config(path, ["data.read_threads=2"]).data.read_threads == 2
    for bad in ("0", "-3", "lots", "true", "1.5"):
        problems = problems_of(path, (f"data.read_threads={bad}",))
        want = "data.read_threads: expected a whole number from 1 to 256 or auto"
        assert len(problems) == 1 and problems[0].startswith(want), bad
    with pytest.raises(ConfigError) as info:
        load_config(path, ["data.read_threads=0"])
    assert info.value.exit_code == 2
