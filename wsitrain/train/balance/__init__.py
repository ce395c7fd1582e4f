"""Ranks that do not wait for each other (``distributed.balance``): which slides each rank trains at each step.

Modules: deal (the dealing itself: ``Balance``, round robin or steps of similar predicted cost), cost (each slide's
predicted step cost from the preflight's plans and tissue grid), waiting (the share of rank-time spent waiting at
the gradient all_reduce, measured and exchanged between ranks).
"""
