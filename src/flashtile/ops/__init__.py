"""Launchers and torch.library custom ops: allocate outputs, pick tile configs, compute grids, launch kernels.

No autograd here (autograd.py) and no argument checking (problem.py, at the public API).
"""
