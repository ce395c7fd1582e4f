"""Slides: readers (OpenSlide, tifffile), resolution choice, tissue detection, streaming into host memory,
augmentation, labelled datasets with prefetching, and synthetic Aperio-style slides.

Import from the submodules (``wsitrain.slides.stream`` etc.); this package imports nothing heavy itself.
"""
