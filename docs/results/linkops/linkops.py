"""Where ZB-V's link time goes on the --paper ResNet (2 ranks, m = 4): the doc's script (docs/benchmarks.md,
"Why ZB-V loses on ResNet when ZB-H1 gains"), adapted, with P2P instrumented.

Per rank and step (mean over the recorded steps, ms):
  link        sum of the SEND/RECV records (the doc's "link ops": posting a batch; no wait happens there)
  post.*      inside P2P.post: wire/contiguous of sends, receive-buffer allocation, dist.isend / dist.irecv calls
  wait        the F/B records' receive waits (P2P.wait)
  wait.dep    of that, the part before the peer had posted the matching send (pipeline dependency)
  wait.xfer   the part after both the send was posted and the wait began (transfer + gloo + wake-up)
  rel         waits on sends (P2P.release inside compute records, finish_sends at the step's end)
perf_counter is CLOCK_MONOTONIC, shared by the two processes, so the peers' times compare directly.
Usage: PYTHONPATH=. python docs/results/linkops/linkops.py [labels...]   (default 1F1B-2 ZB-H1 ZB-V; STEPS=N)"""

import collections
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

from lightning_twobp.bench import paper as P
from lightning_twobp.engine import p2p as P2Pmod
from lightning_twobp.processes import run_distributed

LOG = []  # (kind, rank, key/tag, t0, t1)


def instrument(rank):
    orig_isend, _orig_irecv = dist.isend, dist.irecv
    orig_new, orig_wait, orig_wire = P2Pmod.P2P._new_buffers, P2Pmod.P2P.wait, P2Pmod.TensorMeta.wire
    orig_rel, orig_fin, orig_post = P2Pmod.P2P.release, P2Pmod.P2P.finish_sends, P2Pmod.P2P.post

    def timed(kind, fn):
        def w(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            LOG.append((kind, rank, k.get("tag"), t, time.perf_counter()))
            return out

        return w

    orig_batch = dist.batch_isend_irecv

    def batch(ops):
        c = time.thread_time()
        t = time.perf_counter()
        works = orig_batch(ops)
        t1 = time.perf_counter()
        LOG.append(("batch_cpu", rank, None, 0, time.thread_time() - c))
        for op in ops:  # each op's share of the batch's wall time; a send stamped with the batch's start
            kind = "isend" if op.op is orig_isend else "irecv"
            LOG.append((kind, rank, op.tag, t, t + (t1 - t) / len(ops)))
        if len(works) != len(ops):
            LOG.append(("coalesced", rank, None, 0, 0))
        return works

    dist.batch_isend_irecv = batch
    P2Pmod.P2P._new_buffers = timed("alloc", orig_new)
    P2Pmod.TensorMeta.wire = timed("wire", orig_wire)
    P2Pmod.P2P.release = timed("rel", orig_rel)
    P2Pmod.P2P.finish_sends = timed("fin", orig_fin)

    def post(self, comms, outgoing):
        c0 = time.thread_time()
        for c in comms:
            if c.is_send and c.kind[-1] == "B":
                key = (c.kind[-1], c.stage, c.microbatch)
                for t in outgoing[key]:
                    if not t.is_contiguous():
                        LOG.append(("noncontig", rank, key, 0, 0))
        t = time.perf_counter()
        orig_post(self, comms, outgoing)
        LOG.append(("post", rank, None, t, time.perf_counter()))
        LOG.append(("post_cpu", rank, None, 0, time.thread_time() - c0))

    def wait(self, key):
        direction, stage, mb = key
        edge = stage - 1 if direction == "F" else stage
        tag = self.tag(direction, edge, mb, 0)
        c0 = time.thread_time()
        t = time.perf_counter()
        out = orig_wait(self, key)
        LOG.append(("wait_cpu", rank, None, 0, time.thread_time() - c0))
        LOG.append(("wait", rank, tag, t, time.perf_counter()))
        return out

    P2Pmod.P2P.post, P2Pmod.P2P.wait = post, wait


def worker(rank, world, labels, steps):
    instrument(rank)

    pm = next(p for p in P.models() if p.name == "resnet")
    layers, loss_fn = pm.build()
    x, y = pm.data()
    runners = []
    for lab in labels:  # "ZB-V", "1F1B-2", ...
        name, _, mode = lab.partition(":")
        r = next(r for r in P.rows(False) if r.label == name)
        if mode:  # the receive-posting variants of stop 57's experiment were not landed (docs/benchmarks.md)
            raise SystemExit(f"{lab}: only plain labels here (1F1B-2, ZB-H1, ZB-V, ...)")
        run = P._build(pm, r, layers, loss_fn, x, y, rank, torch.device("cpu"))
        run.key = f"resnet {lab}"
        runners.append(run)
    for r in runners:  # warm-up
        P._timed(r, torch.device("cpu"))
    # alternated: one step of each runner a round (ABC, CBA, ...), timed then recorded
    times = {r.key: [] for r in runners}
    sums = {r.key: collections.Counter() for r in runners}
    logs = {r.key: [] for r in runners}
    for i in range(steps):
        for r in runners if i % 2 == 0 else runners[::-1]:
            times[r.key].append(P._timed(r, torch.device("cpu")))
        for r in runners if i % 2 == 0 else runners[::-1]:
            r.executor.record = True
            r.zero()
            dist.barrier()
            del LOG[:]
            t0 = time.perf_counter()
            res = r.step()
            t1 = time.perf_counter()
            r.executor.record = False
            for rec in res.records:
                kind = "link" if "SEND" in rec.op or "RECV" in rec.op else re.sub("[0-9]", "", rec.op)
                sums[r.key][kind] += (rec.end - rec.start) / steps
                sums[r.key]["wait"] += rec.wait / steps
            sums[r.key]["step_rec"] += (t1 - t0) / steps
            logs[r.key].append(list(LOG))
    out = {
        r.key: dict(step=statistics.median(times[r.key]), sums=dict(sums[r.key]), logs=logs[r.key], steps=steps)
        for r in runners
    }
    return out


def analyse(results, label, steps):
    def ms(s):
        return round(s * 1e3, 2)

    per_rank = [rows[label] for rows in results]
    for rank, row in enumerate(per_rank):
        c = collections.Counter()
        for mine, theirs in zip(row["logs"], per_rank[1 - rank]["logs"], strict=False):
            sends = {tag: t0 for kind, _, tag, t0, t1 in theirs if kind == "isend"}  # the send batch's start
            for kind, _, tag, t0, t1 in mine:
                if kind in (
                    "isend",
                    "irecv",
                    "alloc",
                    "wire",
                    "post",
                    "rel",
                    "fin",
                    "post_cpu",
                    "batch_cpu",
                    "wait_cpu",
                ):
                    c[kind] += t1 - t0
                    c["n_" + kind] += 1
                elif kind == "wait":
                    posted = sends[tag]
                    c["wait"] += t1 - t0
                    c["wait.dep"] += max(0.0, min(posted, t1) - t0)
                    c["wait.xfer"] += t1 - max(posted, t0)
                    c["xfer_max"] = max(c["xfer_max"], t1 - max(posted, t0))
                elif kind in ("noncontig", "coalesced"):
                    c[kind] += 1
        per = sorted(
            round((t1 - t0) * 1e3, 2) for lg in row["logs"] for kind, _, _, t0, t1 in lg if kind in ("isend", "irecv")
        )
        quartiles = f"{per[len(per) // 4]} {per[3 * len(per) // 4]}"
        print(f"  per post op (ms, all steps): median {per[len(per) // 2]}, quartiles {quartiles}, max {per[-1]}")
        sums = row["sums"]
        print(
            f"{label:7} rank {rank}: step {ms(row['step'])} (recorded {ms(sums['step_rec'])}); "
            f"records: link {ms(sums.get('link', 0))}, "
            + ", ".join(f"{k} {ms(v)}" for k, v in sorted(sums.items()) if k not in ("link", "step_rec"))
        )
        print(
            (
                "          post {post} [isend {isend} x{n}, irecv {irecv} x{m}, alloc {alloc}, wire {wire}]; "
                "wait {wait} = dep {dep} + xfer {xfer} (max one {xm}); rel {rel}, fin {fin}; "
                "noncontig B sends {nc}; coalesced {co}\n"
                "          CPU time of this thread: post {pc} (of which batch_isend_irecv {bc}), wait {wc}"
            ).format(
                post=ms(c["post"] / steps),
                isend=ms(c["isend"] / steps),
                irecv=ms(c["irecv"] / steps),
                n=c["n_isend"] // steps,
                m=c["n_irecv"] // steps,
                alloc=ms(c["alloc"] / steps),
                wire=ms(c["wire"] / steps),
                wait=ms(c["wait"] / steps),
                dep=ms(c["wait.dep"] / steps),
                xfer=ms(c["wait.xfer"] / steps),
                xm=ms(c["xfer_max"]),
                rel=ms(c["rel"] / steps),
                fin=ms(c["fin"] / steps),
                nc=c["noncontig"] // steps,
                co=c["coalesced"],
                pc=ms(c["post_cpu"] / steps),
                bc=ms(c["batch_cpu"] / steps),
                wc=ms(c["wait_cpu"] / steps),
            )
        )


if __name__ == "__main__":
    labels = sys.argv[1:] or ["1F1B-2", "ZB-H1", "ZB-V"]
    steps = int(__import__("os").environ.get("STEPS", 5))
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    results = run_distributed(worker, 2, labels, steps, timeout=280)
    for lab in labels:
        analyse(results, f"resnet {lab}", steps)
