"""Pure ``@triton.jit`` code: one kernel per parallelisation strategy plus the helpers they share.

Nothing in this package imports torch; launchers live in :mod:`flashtile.ops`.
"""
