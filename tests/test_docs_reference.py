"""The reference pages cannot drift from the code: docs/reference/config.md has one entry per config key of
wsitrain/config.py, docs/reference/cli.md a section per command of wsitrain/cli.py (and names each of its options)."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
import typer
from pydantic import BaseModel

from wsitrain.cli import app
from wsitrain.config import WsiTrainConfig

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference"
# An entry is a heading of exactly this form: ### `section.key`
ENTRY = re.compile(r"^### `([^`]+)`\s*$", re.MULTILINE)
COMMAND = re.compile(r"^## `wsitrain ([a-z0-9-]+)`\s*$", re.MULTILINE)


def sections_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds, through ``X | None``, unions, ``Annotated``, lists and dicts."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = get_origin(annotation)
    if origin is Annotated:
        return sections_in(get_args(annotation)[0])
    if origin in (Union, types.UnionType, list, tuple, set, dict):
        return [m for a in get_args(annotation) for m in sections_in(a)]
    return []


def key_paths(model: type[BaseModel] = WsiTrainConfig, prefix: str = "") -> tuple[list[str], list[str]]:
    """(leaf keys, section keys) of a config model as dotted paths; a dict of sections adds ``.<name>``."""
    leaves: list[str] = []
    sections: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        subs = sections_in(field.annotation)
        if not subs:
            leaves.append(path)
            continue
        sections.append(path)
        inner = path + ".<name>" if get_origin(field.annotation) is dict else path
        for sub in subs:
            sub_leaves, sub_sections = key_paths(sub, inner + ".")
            leaves += sub_leaves
            sections += sub_sections
    return leaves, sections


def missing_and_stale(text: str, leaves: list[str], sections: list[str]) -> tuple[list[str], list[str]]:
    """Leaf keys without an entry, and entries that name no key (a section key may have an entry of its own)."""
    entries = ENTRY.findall(text)
    missing = [k for k in leaves if k not in entries]
    stale = [e for e in entries if e not in leaves and e not in sections]
    return missing, stale


def test_every_config_key_has_one_entry_and_every_entry_a_key() -> None:
    leaves, sections = key_paths()
    assert len(leaves) > 50 and "model.attention.dim" in leaves and "train.head_warmup.layout" in leaves
    text = (DOCS / "config.md").read_text()
    missing, stale = missing_and_stale(text, leaves, sections)
    assert not missing, f"docs/reference/config.md has no entry for config key(s): {', '.join(missing)}"
    assert not stale, f"docs/reference/config.md has entries for key(s) that do not exist: {', '.join(stale)}"
    entries = ENTRY.findall(text)
    twice = sorted({e for e in entries if entries.count(e) > 1})
    assert not twice, f"docs/reference/config.md has more than one entry for: {', '.join(twice)}"


def test_each_entry_gives_type_default_and_a_short_meaning() -> None:
    text = (DOCS / "config.md").read_text()
    # the entry's body: from its heading to the next heading
    for key, body in re.findall(r"^### `([^`]+)`\s*\n(.*?)(?=^#{2,3} |\Z)", text, re.MULTILINE | re.DOTALL):
        lines = [line for line in body.strip().splitlines() if line.strip()]
        first = lines[0] if lines else ""
        assert re.match(r"Type: .+\. Default: .+\.$", first), f"{key}: first line must be 'Type: T. Default: D.'"
        assert 1 <= len(lines) - 1 <= 3, f"{key}: 1-3 lines of meaning (longer explanations go to the guide)"


def test_the_walk_catches_a_key_added_without_an_entry() -> None:
    """The check above fails on a new field: here a model with one key more than the page documents."""

    class Extra(BaseModel):
        documented: int = 0
        brand_new: float | None = None

    class Root(BaseModel):
        section: Extra | None = None
        listed: list[Extra] = []

    leaves, sections = key_paths(Root)
    assert leaves == ["section.documented", "section.brand_new", "listed.documented", "listed.brand_new"]
    text = "### `section.documented`\n### `listed.documented`\n### `listed.brand_new`\n### `section.gone`\n"
    assert missing_and_stale(text, leaves, sections) == (["section.brand_new"], ["section.gone"])


def _commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    return dict(group.commands)  # type: ignore[attr-defined]


def test_every_cli_command_has_a_section_naming_its_options() -> None:
    text = (DOCS / "cli.md").read_text()
    commands = _commands()
    assert {"fit", "predict", "plan", "validate", "report"} <= set(commands)
    documented = COMMAND.findall(text)
    missing = [c for c in commands if c not in documented]
    assert not missing, f"docs/reference/cli.md has no section '## `wsitrain NAME`' for: {', '.join(missing)}"
    stale = [c for c in documented if c not in commands]
    assert not stale, f"docs/reference/cli.md has sections for command(s) that do not exist: {', '.join(stale)}"
    sections = dict(re.findall(r"^## `wsitrain ([a-z0-9-]+)`\s*\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL))
    for name, cmd in commands.items():
        for param in cmd.params:
            for opt in [o for o in param.opts if o.startswith("--")]:
                assert f"`{opt}`" in sections[name], f"docs/reference/cli.md, wsitrain {name}: option {opt} not named"


@pytest.mark.parametrize("page", ["config.md", "cli.md"])
def test_reference_pages_exist_in_the_site_nav(page: str) -> None:
    nav = (DOCS.parents[1] / "mkdocs.yml").read_text()
    assert f"reference/{page}" in nav
