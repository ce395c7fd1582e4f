"""Patch encoders (ViTs, pathology foundation models, any ``(B, 3, p, p) -> (B, D)`` module) applied to a grid of
patches and trained end to end over every tissue patch of a slide: the encoders themselves (encoders.py), the trunk
the SFT engine tiles in whole patches (trunk.py) and what one patch costs it (cost.py)."""
