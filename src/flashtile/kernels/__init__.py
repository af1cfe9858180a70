"""Pure ``@triton.jit`` / ``@gluon.jit`` code: one kernel per parallelisation strategy plus the helpers they share.

Nothing in this package imports torch; launchers live in :mod:`flashtile.ops`.

Note [runtime integers]: Triton's launcher specialises every integer argument it is not told otherwise about: a
value of 1 becomes a compile-time constant, and a multiple of 16 is marked as such. The ptxas inside Triton 3.6
crashed (SIGSEGV, "error code -11") on prefill kernels built for a length of 1 (dense causal 239 x 1 at head dims
64-256, one query over 339 keys at d40 and d160, a length-1 forward+backward at d64), which no check had built.
So the prefill kernels (forward, backward, their Gluon versions, the varlen plan) annotate every integer that
carries a length, a count, a window size or the stride of an LSE, ALiBi or index tensor as `tl.int32`: Triton
then never turns its value into a constant, but still marks a multiple of 16 as one, so every other launch
compiles exactly as before (sm_90 SASS instruction for instruction the same, tests/sm90_compile.py's scenarios at
lengths that are multiples of 16). `do_not_specialize` would also drop the divisibility, and the Triton backward
ran 6-9% slower without it (H200, d64). The strides of the data tensors stay unannotated, and the prefill
launchers pass a size-1 dimension's stride as its contiguous one (ops/descriptors.kernel_strides), so none of them is 1
either. The decode kernels keep Triton's specialisation: a decode step's single query token as a constant is what their
tiles were measured on, and no crash was seen there; the CPU compile check builds the specialisations its decode
scenarios launch, ones included, and fails a prefill kernel with an integer turned into a constant.
"""
