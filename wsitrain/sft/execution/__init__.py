"""Execution of a ``Plan``: tiled and multi-pass segments, host staging and copies, per-tile statistics.
Reads plans and frozen facts; never imports ``wsitrain.sft.planning``.
"""
