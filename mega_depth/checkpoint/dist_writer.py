"""megatron-core's dist-checkpoint writer, run inside the trainer's own process: no forked writer, no helper process.

megatron-core 0.16.1's FileSystemWriterAsync, which every save goes through (synchronous ones too), forks one writer
process per bucket (`write_preloaded_data_multiproc`, `thread_count` = 2 buckets a rank) and collects their results
through a queue served by a Manager process that it spawns on first use. That is three hazards for a trainer:
- fork() copies a process that runs gloo / NCCL, OpenMP and Triton threads. A lock one of them held at that moment
  stays held in the child, which then waits forever, and so does the rank that waits for the child (PyTorch's docs:
  "poison fork"). On CI a tp2 x pp2 save stopped at this step on both ranks of the last stage, until gloo's
  10-minute timeout; a forked child that uses OpenMP after the parent did hangs every time (torch 2.13 CPU).
- the Manager and multiprocessing's resource tracker do not watch their parent: a kill -9 of the trainer leaves them
  running (about 275 MB a rank), and a writer left behind holds the trainer's stdout open.
- a pre-emption's SIGTERM reaches the whole process group (torchrun stops its workers with killpg), helpers included,
  while the trainer still needs them for its pre-emption save.
Megatron-LM made the same change later (`--dist-ckpt-workers 1`, its default, NVIDIA/Megatron-LM#3633): the writes
run in the training process. Here each bucket is written on a thread of the trainer (file writes and fsync release
the GIL, so the buckets still write in parallel) and the results go through in-process queues, with megatron-core's
own bucket writer and its result protocol unchanged.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List


def _write_buckets_on_threads(transform_list: List[Any], use_msc: bool, rank: int, write_buckets: List[Any],
                              global_results_queue) -> None:
    """megatron-core's `write_preloaded_data_multiproc`, with threads for its forked processes: puts {bucket index:
    write results} (or the first bucket's exception) on `global_results_queue`, as the original does."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results, count = queue.Queue(), queue.Queue()  # the bucket writer's two queues: its results, and "done"

    def write(index: int, bucket) -> None:
        count.put(index)  # the writer takes one item and marks it done when it finishes
        extra = {"use_msc": use_msc} if use_msc else {}
        FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, results, count, True, **extra)

    with ThreadPoolExecutor(max_workers=max(1, len(write_buckets)), thread_name_prefix="dist-ckpt-writer") as pool:
        for future in [pool.submit(write, i, bucket) for i, bucket in enumerate(write_buckets)]:
            future.result()  # the writer catches an Exception into its result; anything else propagates here
    collected: Any = {}
    for _ in write_buckets:
        index, result = results.get_nowait()
        if isinstance(result, Exception):
            collected = result
            break
        collected[index] = result
    global_results_queue.put(collected)


def install() -> None:
    """Route megatron-core's writes through this process's threads (idempotent; call before each save). The results
    queue is a fresh in-process queue each save: nothing left by a failed save is read by the next."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_write_buckets_on_threads)
    filesystem_async._results_queue = queue.Queue()
