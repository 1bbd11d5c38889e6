"""Raw gloo point-to-point floor between 2 processes (1 thread each, run_distributed), the message sizes of the
--paper ResNet's pipeline cuts: (4, 128, 8, 8) and (4, 256, 4, 4) fp32 (128 and 64 KiB).

  pingpong: rank 0 isend + wait, rank 1 (receive pre-posted) irecv.wait then isend back; one way = RTT / 2
  post:     the cost of the isend / irecv call alone (what an engine SEND/RECV record holds)
  late:     receive posted only after the send arrived at the receiver's side (send first, receiver sleeps 2 ms,
            then posts and waits): the time from posting the receive to its end (the rendezvous round trip)
Medians over N repeats, microseconds. Usage: PYTHONPATH=. python docs/results/linkops/floor.py [N]"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

from lightning_twobp.processes import run_distributed

SHAPES = [(4, 128, 8, 8), (4, 256, 4, 4)]
if __import__("os").environ.get("REVERSE"):
    SHAPES = SHAPES[::-1]


def worker(rank, world, n):
    out = {}
    peer = 1 - rank
    for shape in SHAPES:
        t = torch.randn(shape)
        buf = torch.empty(shape)
        rtt, post_s, post_r, late, early_post, early_wait = [], [], [], [], [], []
        for i in range(n + 5):
            dist.barrier()
            if rank == 0:
                a = time.perf_counter()
                w = dist.isend(t, peer, tag=1)
                b = time.perf_counter()
                r = dist.irecv(buf, peer, tag=2)
                c = time.perf_counter()
                w.wait()
                r.wait()
                d = time.perf_counter()
                if i >= 5:
                    rtt.append(d - a)
                    post_s.append(b - a)
                    post_r.append(c - b)
            else:
                r = dist.irecv(buf, peer, tag=1)
                r.wait()
                dist.isend(buf, peer, tag=2).wait()
            # late receive: the sender posts first, the receiver posts 2 ms later
            dist.barrier()
            if rank == 0:
                dist.isend(t, peer, tag=3).wait()
            else:
                time.sleep(0.002)
                a = time.perf_counter()
                dist.irecv(buf, peer, tag=3).wait()
                if i >= 5:
                    late.append(time.perf_counter() - a)
            # early receive: the receiver posts, then the sender (2 ms later) posts its send: the send's post cost
            # and the time until the receiver's wait ends
            if rank == 1:
                r = dist.irecv(buf, peer, tag=4)
            dist.barrier()
            if rank == 0:
                time.sleep(0.002)
                a = time.perf_counter()
                w = dist.isend(t, peer, tag=4)
                if i >= 5:
                    early_post.append(time.perf_counter() - a)
                w.wait()
                if i >= 5:
                    early_wait.append(time.perf_counter() - a)
            else:
                r.wait()

        def med(v):
            return round(statistics.median(v) * 1e6, 1) if v else None

        out[shape] = dict(
            one_way=med([x / 2 for x in rtt]),
            post_isend=med(post_s),
            post_irecv=med(post_r),
            late_recv=med(late),
            early_send_post=med(early_post),
            early_send_done=med(early_wait),
        )
    return out


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    res = run_distributed(worker, 2, n, timeout=280)
    for shape in SHAPES:
        print(
            shape,
            f"{torch.Size(shape).numel() * 4 // 1024} KiB",
            "rank0",
            res[0][shape],
            "rank1 late_recv",
            res[1][shape]["late_recv"],
            "us",
        )
