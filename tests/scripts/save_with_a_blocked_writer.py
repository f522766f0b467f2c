"""A dist-checkpoint save whose bucket writer blocks mid-write: the kill -9 test's deterministic half.

The forked writer records its pid in `<out>/writer.pid` and then sleeps, so the test can kill this process while a
writer is certainly alive and check that the writer dies with it (writer_queue's parent-death signal).
Usage: python save_with_a_blocked_writer.py OUT_DIR
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async

from mega_depth.checkpoint import writer_queue
from mega_depth.megatron import cpu_compat
from mega_depth.training.distributed import free_port



def blocked_write(*args, **kwargs):
    out = sys.argv[1]
    with open(os.path.join(out, "writer.pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, "writer.pid.tmp"), os.path.join(out, "writer.pid"))
    time.sleep(3600)


if __name__ == "__main__":  # the Manager is spawned, and spawning imports this file again
    cpu_compat.apply()  # as every entry point does (a no-op with CUDA)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    filesystem_async._write_item = blocked_write  # runs inside the forked bucket writer
    writer_queue.install()
    os.makedirs(os.path.join(sys.argv[1], "ckpt"))
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))},
                            os.path.join(sys.argv[1], "ckpt"))
