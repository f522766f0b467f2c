"""A dist-checkpoint save whose bucket write blocks mid-write, so that the test can look at the save while it runs.

The write records where it runs (pid and thread name) in `<out>/writer.json` and then sleeps: the test checks that it
runs on a thread of this process, with no helper process beside it (dist_writer), and kills this process.
Usage: python save_with_a_blocked_writer.py OUT_DIR
"""

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async

from mega_depth.checkpoint import dist_writer
from mega_depth.megatron import cpu_compat
from mega_depth.training.distributed import free_port


def blocked_write(*args, **kwargs):
    out = sys.argv[1]
    with open(os.path.join(out, "writer.json.tmp"), "w") as f:
        json.dump({"pid": os.getpid(), "thread": threading.current_thread().name}, f)
    os.replace(os.path.join(out, "writer.json.tmp"), os.path.join(out, "writer.json"))
    time.sleep(3600)


if __name__ == "__main__":
    cpu_compat.apply()  # as every entry point does (a no-op with CUDA)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    filesystem_async._write_item = blocked_write  # what megatron-core's bucket writer calls for each item
    dist_writer.install()
    os.makedirs(os.path.join(sys.argv[1], "ckpt"))
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))},
                            os.path.join(sys.argv[1], "ckpt"))
