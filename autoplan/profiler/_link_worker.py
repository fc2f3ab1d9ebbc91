"""One rank of :func:`autoplan.profiler.links.benchmark_links`, run as
``python -m autoplan.profiler._link_worker RANK WORLD RENDEZVOUS_FILE RESULT_FILE SETTINGS_JSON``."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from autoplan.profiler.timing import STATISTICS


def _worker(rank: int, world: int, init_file: str, out_file: str, settings: dict) -> None:
    import torch
    import torch.distributed as dist

    backend = settings["backend"]
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        # One thread per rank: the ranks share this machine's cores.
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def barrier():
        if cuda:
            dist.barrier(device_ids=[rank])  # nccl needs to know this rank's GPU
        else:
            dist.barrier()

    def make(op: str, nbytes: int):
        numel = max(world, nbytes // 4 // world * world)
        if op == "all_reduce":
            t = torch.ones(numel, device=device)
            return lambda: dist.all_reduce(t)
        if op == "all_gather":
            out = torch.empty(numel, device=device)
            inp = torch.ones(numel // world, device=device)
            return lambda: dist.all_gather_into_tensor(out, inp)
        if op == "reduce_scatter":
            inp = torch.ones(numel, device=device)
            out = torch.empty(numel // world, device=device)
            return lambda: dist.reduce_scatter_tensor(out, inp)
        if op == "all_to_all":
            inp = torch.ones(numel, device=device)
            out = torch.empty(numel, device=device)
            return lambda: dist.all_to_all_single(out, inp)
        buf = torch.ones(numel, device=device)

        def ping():
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        return ping

    samples, unsupported = [], {}
    for op in settings["ops"]:
        for nbytes in settings["sizes"]:
            fn = make(op, nbytes)
            try:
                for _ in range(settings["warmup"]):
                    fn()
                sync()
            except (RuntimeError, NotImplementedError) as e:
                unsupported[op] = str(e).splitlines()[0][:200]
                break
            times = []
            cap = 10 * settings["repeats"]
            while True:
                barrier()
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - t0)
                # Every rank must agree on whether to go on: decide on the slowest one's view.
                go = torch.tensor([float(len(times) < settings["repeats"] or (
                    sum(times) < settings["min_time_s"] and len(times) < cap))],
                    device=device if cuda else "cpu")
                dist.all_reduce(go, op=dist.ReduceOp.MAX)
                if not go.item():
                    break
            # A collective is done when its slowest rank is: per repeat, the max over ranks.
            per = torch.tensor(times, dtype=torch.float64, device=device if cuda else "cpu")
            dist.all_reduce(per, op=dist.ReduceOp.MAX)
            per = per.cpu().tolist()
            half = 0.5 if op == "p2p" else 1.0  # a round trip is two one-way transfers
            stats = {name: fn_(per) * half * 1e6 for name, fn_ in STATISTICS.items()}
            samples.append({"op": op, "bytes": int(max(world, nbytes // 4 // world * world) * 4),
                            "time_us": stats[settings["statistic"]], "repeats": len(per),
                            **{f"{k}_us": v for k, v in stats.items()}})
    if rank == 0:
        Path(out_file).write_text(json.dumps({"samples": samples, "unsupported": unsupported}))
    barrier()
    dist.destroy_process_group()



if __name__ == "__main__":
    _rank, _world, _init, _out, _settings = sys.argv[1:6]
    _worker(int(_rank), int(_world), _init, _out, json.loads(_settings))
