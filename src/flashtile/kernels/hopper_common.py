"""What the two Gluon Hopper kernels (hopper_fwd.py, hopper_bwd.py) share: the barriers of their producer/consumer
ring. Gluon only (sm_90); the Triton kernels have no such thing.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """(held, ready, empty): `held` completes once for each consumer's tiles that stay for the whole program (its Q
    tile in the forward, its K and V in dK/dV); `ready[s]` when the loader's TMA has filled ring slot s;
    `empty[s]` when both consumers have read it (count 2), which the loader waits for before refilling it."""
    held = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(held.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival from each consumer
    fence_async_shared()  # the initialised barriers, before the TMA unit and the other partitions use them
    return held, ready, empty
