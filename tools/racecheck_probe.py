"""Whether compute-sanitizer's racecheck follows mbarrier ordering, on a kernel whose only synchronisation is one.

A one-warp producer partition writes a shared tile with ordinary stores, orders them (thread barrier) and arrives
on an mbarrier; a four-warp consumer partition waits on that mbarrier and reads the tile. With `1` the wait is
there and the program is race-free: the copy comes out equal. With `0` there is no wait: a real race, the positive
control. The Gluon kernels hand work items, zeroed tile rows and buffers between partitions exactly so
(hopper_common.publish_item, zero_rows_from, BufferSets), so what racecheck reports for `1` is what its reports on
those kernels are worth (docs/design/testing.md, "Stress and sanitizers").

    compute-sanitizer --tool racecheck --racecheck-report all python3 tools/racecheck_probe.py 1
"""

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

ROWS, COLS = 32, 16


@gluon.jit
def _consumer(buf, bar, OUT, WAIT: gl.constexpr):
    if WAIT:
        mbarrier.wait(bar.index(0), 0)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    rows = gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
    gl.store(OUT + gl.expand_dims(rows, 1) * 16 + gl.expand_dims(cols, 0), buf.load(layout))


@gluon.jit
def _producer(buf, bar, IN):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0])
    rows = gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
    buf.store(gl.load(IN + gl.expand_dims(rows, 1) * 16 + gl.expand_dims(cols, 0)))
    gl.thread_barrier()  # the warp's stores before its one thread's arrival, as publish_item does
    mbarrier.arrive(bar.index(0), count=1)


@gluon.jit
def handoff_kernel(IN, OUT, WAIT: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [32, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    fence_async_shared()
    gl.warp_specialize([(_consumer, (buf, bar, OUT, WAIT)), (_producer, (buf, bar, IN))], [1], [24])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wait", type=int, choices=(0, 1), nargs="?", default=1,
                        help="1: the consumer waits on the mbarrier (race-free); 0: it does not (a real race)")
    wait = parser.parse_args(argv).wait
    x = torch.randn(ROWS, COLS, device="cuda")
    out = torch.zeros_like(x)
    handoff_kernel[(1,)](x, out, WAIT=wait, num_warps=4)
    torch.cuda.synchronize()
    print(f"wait={wait}: copy {'equal' if torch.equal(out, x) else 'differs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
