"""Operators: how each layer maps output intervals to input intervals, what it saves, and which layers
need a statistic of the whole map (barriers) or fold into a global pool.
"""
