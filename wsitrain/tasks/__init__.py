"""Beyond classes: regression, survival and multi-label tasks (vocabulary, losses, metrics, splits, CSV columns).

Kept free of heavy imports at package level: ``wsitrain.config`` imports ``wsitrain.tasks.kinds``.
"""
