"""All-reduce bandwidth of torch.distributed's gloo backend on this CPU, the reference for
keel-collective's CPU backend: `world` processes on one machine, each all-reducing (sum) an
f32 tensor of each size, one thread each, timed after a warm-up. Prints the same JSON lines
as shared/keel-collective/examples/all_reduce_bandwidth.rs.

    .venv/bin/python bench/collective_reference.py [WORLD...]
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [1 << 16, 1 << 20, 1 << 22, 1 << 24]


def rank_main(rank, world, port, queue):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for elements in SIZES:
        iters = max(5, min(200, 256 * 1024 * 1024 // (elements * 4)))
        t = torch.ones(elements)
        for _ in range(3):
            dist.all_reduce(t)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        dist.barrier()
        seconds = (time.perf_counter() - started) / iters
        gathered = [None] * world
        dist.all_gather_object(gathered, seconds)
        if rank == 0:
            seconds = max(gathered)
            nbytes = elements * 4
            algbw = nbytes / seconds / 1e9
            busbw = algbw * 2 * (world - 1) / world
            queue.put({"impl": "torch-gloo", "world": world, "bytes": float(nbytes), "iters": iters,
                       "seconds": round(seconds, 6), "algbw_gbps": round(algbw, 3), "busbw_gbps": round(busbw, 3)})
    dist.destroy_process_group()


def main():
    worlds = [int(a) for a in sys.argv[1:]] or [2, 4]
    ctx = mp.get_context("spawn")
    for i, world in enumerate(worlds):
        queue = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, world, 29500 + i, queue)) for r in range(world)]
        for p in procs:
            p.start()
        for _ in SIZES:
            print(json.dumps(queue.get()), flush=True)
        for p in procs:
            p.join()


if __name__ == "__main__":
    main()
