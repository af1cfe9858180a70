"""Pure ``@triton.jit`` / ``@gluon.jit`` code: one kernel per parallelisation strategy plus the helpers they share.

Nothing in this package imports torch; launchers live in :mod:`flashtile.ops`.

Note [runtime integers]: Triton's launcher specialises every integer argument it is not told otherwise about: a
value of 1 becomes a compile-time constant, and a multiple of 16 is marked as such. Each specialisation is another
kernel to compile, and the ptxas inside Triton 3.6 crashed (SIGSEGV, "error code -11") on some of those built
for a length of 1 (dense causal 239 x 1 at head dims 64-256, one query over 339 keys at d40 and d160, a
length-1 forward+backward at d64), which no check had built. So every integer that carries a length, a count, a
position, a window size or the stride of an index or LSE tensor is listed in its kernel's `do_not_specialize`:
one compiled kernel serves every value, 1 included, and the compiler never sees a length as a constant. The
strides of the data tensors stay specialised, since their divisibility by 16 is what lets Triton vectorise and
pipeline pointer loads; the launchers pass a size-1 dimension's stride as its contiguous one
(ops/common.kernel_strides), so none of them is 1 either. The CPU compile check (tests/sm90_compile.py) builds
what the launchers ask for with the specialisations Triton derives, lengths of 1 among its scenarios, and fails a
kernel with an integer turned into a constant.
"""
