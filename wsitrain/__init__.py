"""wsitrain: train CNNs end-to-end on whole-slide images with exact segmented fused-tiled execution."""

# The version of pyproject.toml (tests/test_packaging.py checks they agree); CHANGELOG.md says what each added.
__version__ = "0.5.0"
