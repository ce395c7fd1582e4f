"""``wsitrain info``: open a slide with the reader that fits it and return its metadata record."""

from __future__ import annotations

from pathlib import Path

from wsitrain.slides.metadata import SlideInfo
from wsitrain.slides.readers import open_slide

__all__ = ["SlideInfo", "slide_info"]


def slide_info(path: str | Path) -> SlideInfo:
    """Open ``path`` with the reader that fits it and return its facts.

    A missing or unreadable file raises ``SlideError`` naming the file.
    """
    with open_slide(path) as reader:
        return reader.info
