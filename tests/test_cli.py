"""The command line: help for every command, version, validate, error formatting and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from wsitrain import __version__
from wsitrain.cli import app

COMMANDS = ["fit", "predict", "plan", "bench", "synth", "validate", "info", "report", "check-model"]
runner = CliRunner()


def invoke(*args: str):
    # COLUMNS: rich wraps at the terminal width; a wide one keeps each message on one line for the asserts.
    return runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_app_help_lists_every_command() -> None:
    result = invoke("--help")
    assert result.exit_code == 0, result.output
    for name in COMMANDS:
        assert name in result.output
    for option in ("--version", "--quiet", "--verbose"):
        assert option in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command: str) -> None:
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert "Example" in result.output  # every command's help shows how to call it


def test_no_arguments_shows_help() -> None:
    result = invoke()
    assert "Usage:" in result.output and "fit" in result.output


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.output.strip() == f"wsitrain {__version__}"


def test_validate_demo_config(repo_root: Path) -> None:
    path = repo_root / "configs" / "demo.yaml"
    result = invoke("validate", str(path))
    assert result.exit_code == 0, result.output
    assert f"{path} is valid" in result.output
    assert "tiny" in result.output and "24 synthetic slides" in result.output


def test_validate_with_override(repo_root: Path) -> None:
    result = invoke("validate", str(repo_root / "configs" / "demo.yaml"), "--set", "train.lr=1e-4")
    assert result.exit_code == 0, result.output
    assert "lr 0.0001" in result.output


def test_validate_reports_all_three_mistakes(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  name: vgg61\n  colour: red\ntrain:\n  lr: fast\n")
    result = invoke("validate", str(path))
    assert result.exit_code == 2, result.output
    out = result.output
    assert "error:" in out and "3 problems" in out and str(path) in out
    assert "model.colour: unknown key; valid keys here: name, num_classes" in out
    assert "model.name: 'vgg61' is not a valid choice; choose one of tiny, tiny_bn, tiny_ln, vgg16" in out
    assert "train.lr: expected a number, got 'fast'" in out
    assert "hint:" in out
    assert "Traceback" not in out


def test_validate_bad_override_exits_2(repo_root: Path) -> None:
    result = invoke("validate", str(repo_root / "configs" / "demo.yaml"), "--set", "train.nope=1")
    assert result.exit_code == 2
    assert "train.nope" in result.output and "valid keys here" in result.output


def test_validate_missing_config_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    result = invoke("validate", str(path))
    assert result.exit_code == 2
    assert "file not found" in result.output and "absent.yaml" in result.output


def test_errors_go_to_stderr(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train: {lr: fast}\n")
    result = invoke("--quiet", "validate", str(path))
    assert result.exit_code == 2
    assert "train.lr" in result.stderr  # --quiet hides progress, never errors
    assert result.stdout == ""


def test_quiet_hides_normal_output(repo_root: Path) -> None:
    result = invoke("-q", "validate", str(repo_root / "configs" / "demo.yaml"))
    assert result.exit_code == 0
    assert result.output == ""


def test_info_missing_slide_exits_2_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "no-such-slide.svs"
    result = invoke("info", str(path))
    assert result.exit_code == 2, result.output
    assert "no-such-slide.svs" in result.output
    assert "error:" in result.output


def test_info_real_slide_table_and_json(shared_slides: Path) -> None:
    path = shared_slides / "cmu-1-small-region.svs"
    table = invoke("info", str(path))
    assert table.exit_code == 0, table.output
    assert "aperio" in table.output and "2220" in table.output and "2967" in table.output
    as_json = invoke("info", str(path), "--json")
    assert as_json.exit_code == 0, as_json.output
    facts = json.loads(as_json.stdout)
    assert facts["vendor"] == "aperio" and facts["dimensions"] == [2220, 2967]


def test_info_broken_slide_exits_2(shared_slides: Path) -> None:
    result = invoke("info", str(shared_slides / "broken.svs"))
    assert result.exit_code == 2, result.output
    assert "broken.svs" in result.output


def test_internal_error_exits_1_without_traceback(monkeypatch: pytest.MonkeyPatch, repo_root: Path) -> None:
    import wsitrain.config

    def boom(*_args, **_kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(wsitrain.config, "load_config", boom)
    result = invoke("validate", str(repo_root / "configs" / "demo.yaml"))
    assert result.exit_code == 1
    assert "internal error: RuntimeError: kaboom" in result.output
    assert "Traceback" not in result.output and "--verbose" in result.output
    verbose = invoke("--verbose", "validate", str(repo_root / "configs" / "demo.yaml"))
    assert verbose.exit_code == 1
    assert "Traceback" in verbose.output and "kaboom" in verbose.output


def test_missing_module_is_reported_as_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    # A None entry in sys.modules makes `import wsitrain.slides.synth` raise ModuleNotFoundError, as if it were absent.
    monkeypatch.setitem(sys.modules, "wsitrain.slides.synth", None)
    result = invoke("synth", "out")
    assert result.exit_code == 3
    assert "`wsitrain synth` is not available yet" in result.output


def test_python_dash_m_runs_the_cli() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "wsitrain", "--version"], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wsitrain {__version__}"


def test_jsonl_writer_appends_one_object_per_line(tmp_path: Path) -> None:
    from wsitrain.train.runfolder import JsonlWriter  # the one JSON-lines writer (metrics, tiles, plans)

    path = tmp_path / "metrics.jsonl"
    w = JsonlWriter(path)
    w.write({"step": 1, "loss": 0.5, "where": Path("a/b"), "auc": float("nan")})
    assert path.read_text().count("\n") == 1  # flushed at once: a crash keeps what was written
    w.close()
    w = JsonlWriter(path)  # a second writer appends (resume), never truncates
    w.write({"step": 2, "loss": 0.25})
    w.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.5, "where": "a/b", "auc": None}, {"step": 2, "loss": 0.25}]
    JsonlWriter(None).write({"step": 3})  # a non-main rank writes nothing, without failing


def test_quiet_hides_progress_but_not_errors(tmp_path: Path, repo_root: Path) -> None:
    ok = invoke("--quiet", "plan", "--model", "tiny", "--size", "256", "--memory", "1GiB")
    assert ok.exit_code == 0 and ok.stdout == ""
    bad = invoke("--quiet", "plan", "--model", "tiny", "--size", "256", "--memory", "lots")
    assert bad.exit_code == 2 and "--memory" in bad.stderr and bad.stdout == ""


def test_plan_command_prints_the_plan_and_its_envelope() -> None:
    result = invoke("plan", "--model", "vgg16", "--size", "20480", "--gpu", "2080ti")
    assert result.exit_code == 0, result.output
    for text in ("SFT plan for vgg16 on 1x3x20480x20480", "budget source: preset 2080ti", "gpu preset: 2080ti",
                 "host -> device staging", "every square image up to 1048576 x 1048576 px fits"):  # fmt: skip
        assert text in result.stdout, text


def test_plan_tissue_predicts_the_step_with_background_reused() -> None:
    """--tissue: the tiled segments' time scales with the tissue; a bad share is exit 2 naming the option."""
    args = ("plan", "--model", "tiny", "--size", "2048", "--memory", "256MiB", "--tissue")
    out = invoke("--quiet", *args, "0.3", "--json")
    assert out.exit_code == 0, out.output
    d = json.loads(out.stdout)
    assert d["tissue"] == 0.3 and 0 < d["slowdown_at_tissue"] < d["plan"]["slowdown"]
    assert d["plan"]["slowdown_at_half_tissue"] > d["slowdown_at_tissue"]
    text = invoke("plan", "--model", "tiny", "--size", "2048", "--memory", "256MiB", "--tissue", "0.3")
    assert "with tissue in 30% of the tiles" in text.stdout
    bad = invoke("--quiet", "plan", "--model", "tiny", "--size", "2048", "--memory", "256MiB", "--tissue", "1.5")
    assert bad.exit_code == 2 and "--tissue" in bad.stderr


def _import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the wsitrain modules it imports, at the top or inside functions alike (a lazy import is an edge)."""
    import ast

    modules = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles(repo_root: Path) -> None:
    graph = _import_graph(repo_root / "wsitrain")
    assert "wsitrain.slides.stream" in graph and graph["wsitrain.slides.stream"]  # the graph was really read
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]  # the check finds a circle
