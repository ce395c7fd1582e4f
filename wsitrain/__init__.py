"""wsitrain: train CNNs end-to-end on whole-slide images with exact segmented fused-tiled execution."""

__version__ = "0.1.0"
