"""The Docker image's wiring, without Docker: the Dockerfile's base argument and entrypoint, and the entrypoint script
(docker/entrypoint.sh) run by sh as a non-root uid against folders made unwritable.

The image itself is built and trained in by scripts/container/build-local.sh (root, a Docker daemon, minutes), which
CI does not run.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
NOBODY = 65534  # Debian's nobody/nogroup: not root, so file permissions apply to it


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split()[0].upper(), line.split(None, 1)[1]) for line in lines if line and not line.startswith("#")]


def test_dockerfile_takes_its_base_as_an_argument() -> None:
    steps = _instructions()
    keywords = [k for k, _ in steps]
    assert keywords.index("ARG") < keywords.index("FROM"), "ARG BASE must come before FROM to be usable in it"
    assert any(k == "ARG" and re.fullmatch(r"BASE=\S+", a) for k, a in steps), "no `ARG BASE=<default image>`"
    assert ("FROM", "${BASE}") in steps


def test_dockerfile_entrypoint_is_the_script_it_copies() -> None:
    steps = _instructions()
    entry = [a for k, a in steps if k == "ENTRYPOINT"]
    assert len(entry) == 1
    target = re.fullmatch(r'\["([^"]+)"\]', entry[0]).group(1)
    assert ("COPY", f"docker/entrypoint.sh {target}") in steps, f"ENTRYPOINT {target} is not docker/entrypoint.sh"
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert not {"docker", "docker/", "docker/entrypoint.sh", "*.sh"} & ignored, ".dockerignore drops the script"


def test_dockerfile_home_is_writable_by_any_uid() -> None:
    # `docker run --user UID:GID` has no passwd entry: HOME must be set by the image and writable by everyone.
    steps = _instructions()
    home = [re.fullmatch(r"HOME=(\S+)", a) for k, a in steps if k == "ENV"]
    homes = [m.group(1) for m in home if m]
    assert homes, "no `ENV HOME=...`"
    made_world_writable = [a for k, a in steps if k == "RUN" and re.search(rf"chmod 1777 [^&]*{homes[-1]}\b", a)]
    assert made_world_writable, f"HOME {homes[-1]} is not made mode 1777"


@pytest.fixture
def sandbox() -> Iterator[Path]:
    """A folder nobody can use (pytest's tmp_path is under root's mode-700 folder), with stub `wsitrain` and
    `torchrun` programs on PATH that print their name and arguments, one a line."""
    root = Path(tempfile.mkdtemp(prefix="wsitrain-entrypoint-"))
    try:
        root.chmod(0o755)
        bin_dir = root / "bin"
        bin_dir.mkdir()
        for name in ("wsitrain", "torchrun"):
            stub = bin_dir / name
            stub.write_text(f'#!/bin/sh\necho "ran {name}"\nfor a in "$@"; do echo "arg $a"; done\n')
            stub.chmod(0o755)
        shutil.copy(ENTRYPOINT, root / "entrypoint.sh")
        (root / "work").mkdir(mode=0o755)
        yield root
    finally:
        for path in root.rglob("*"):  # the unwritable folders, so rmtree can go through them
            if path.is_dir() and not path.is_symlink():
                path.chmod(stat.S_IRWXU)
        shutil.rmtree(root)


def _run_as() -> tuple[int, int]:
    return (NOBODY, NOBODY) if os.geteuid() == 0 else (os.getuid(), os.getgid())


def _entrypoint(sandbox: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """docker/entrypoint.sh run by sh in sandbox/work, as a non-root uid (root would pass every permission check)."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv (util-linux): cannot drop to a non-root uid")
        prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    env = {"PATH": f"{sandbox / 'bin'}:/usr/bin:/bin", "HOME": str(sandbox / "work")}
    return subprocess.run([*prefix, "sh", str(sandbox / "entrypoint.sh"), *args], cwd=sandbox / "work", env=env,
                          capture_output=True, text=True, timeout=30)


def _locked_runs(sandbox: Path) -> Path:
    """work/runs -> a folder the uid can read but not write, as a root-owned host folder mounted at /runs is."""
    target = sandbox / "mounted"
    target.mkdir(mode=0o555)
    (sandbox / "work" / "runs").symlink_to(target)
    return target


def test_unwritable_runs_exits_2_naming_the_folder_the_uid_and_the_fix(sandbox: Path) -> None:
    target = _locked_runs(sandbox)
    out = _entrypoint(sandbox, "fit", "configs/demo.yaml")
    uid, gid = _run_as()
    assert out.returncode == 2, out
    assert out.stdout == "" and "ran" not in out.stderr, "wsitrain must not start"
    message = out.stderr.strip()
    assert "\n" not in message
    assert f"{target} is not writable by uid {uid} (gid {gid})" in message
    assert "--user $(id -u):$(id -g)" in message and f"chown {uid}:{gid}" in message


def test_unwritable_runs_stops_torchrun_too(sandbox: Path) -> None:
    _locked_runs(sandbox)
    out = _entrypoint(sandbox, "torchrun", "--nproc-per-node", "2", "-m", "wsitrain.cli", "fit", "x.yaml")
    assert out.returncode == 2 and "is not writable by uid" in out.stderr


def test_writable_runs_runs_wsitrain_with_the_arguments_unchanged(sandbox: Path) -> None:
    (sandbox / "work" / "runs").mkdir()
    if os.geteuid() == 0:
        os.chown(sandbox / "work" / "runs", NOBODY, NOBODY)
    out = _entrypoint(sandbox, "fit", "my config.yaml", "--set", "name=a b")
    assert out.returncode == 0, out
    assert out.stdout.splitlines() == ["ran wsitrain", "arg fit", "arg my config.yaml", "arg --set", "arg name=a b"]


def test_torchrun_as_first_argument_runs_torchrun(sandbox: Path) -> None:
    out = _entrypoint(sandbox, "torchrun", "--standalone", "-m", "wsitrain.cli", "fit")
    assert out.returncode == 0, out
    assert out.stdout.splitlines()[:2] == ["ran torchrun", "arg --standalone"]


def test_help_and_version_run_whatever_runs_is(sandbox: Path) -> None:
    _locked_runs(sandbox)
    for args in (["--help"], ["fit", "--help"], ["--version"]):
        out = _entrypoint(sandbox, *args)
        assert out.returncode == 0, out
        assert out.stdout.splitlines()[0] == "ran wsitrain"


def test_a_shell_in_the_image_runs_whatever_runs_is(sandbox: Path) -> None:
    _locked_runs(sandbox)
    out = _entrypoint(sandbox, "sh", "-c", "echo looked around")
    assert (out.returncode, out.stdout) == (0, "looked around\n"), out


def test_no_runs_folder_is_left_to_wsitrain(sandbox: Path) -> None:
    out = _entrypoint(sandbox, "fit", "x.yaml")
    assert out.returncode == 0, out
    assert out.stdout.splitlines()[0] == "ran wsitrain"
