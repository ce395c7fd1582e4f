"""``wsitrain plan``: what the SFT engine would do with a model, an image size and a GPU (``plan.command``).

Laid out like the other commands (``wsitrain.train`` for fit and predict, ``wsitrain.bench``): the package
imports nothing itself, so ``wsitrain --help`` stays fast.
"""
