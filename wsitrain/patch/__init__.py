"""Patch encoders (ViTs, pathology foundation models, any ``(B, 3, p, p) -> (B, D)`` module) trained end to end over
every tissue patch of a slide: the trunk the SFT engine tiles in whole patches (trunk.py), what one patch costs
(cost.py)."""
