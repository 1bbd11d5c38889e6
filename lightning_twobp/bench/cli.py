"""``twobp-bench``: the engine benchmark by default; ``--peer``, ``--trainer``, ``--split``, ``--soak``, ``--paper``,
``--gpu``.

twobp-bench [--json PATH] [--repeats N] [--timelines DIR] [--quick]
twobp-bench --peer [--rounds N] [--steps K] [--out DIR] [--only LABEL ...] [--quick]
twobp-bench --peer --activation-checkpointing {full,selective} [--rounds N] [--steps K] [--out DIR] [--quick]
twobp-bench --trainer [--json PATH] [--repeats N] [--only LABEL ...] [--quick]
twobp-bench --split [--tokens 512 256 64] [--batch-w K]
twobp-bench --split --paper-blocks [--repeats N] [--quick]
twobp-bench --split --moe [--repeats N]
twobp-bench --soak N [--python-memory] [--json PATH]
twobp-bench --paper [--out DIR] [--quick] [--repeats N]
twobp-bench --gpu [--json PATH] [--quick]
twobp-bench --budget [--out DIR] [--steps K] [--only LABEL ...] [--counts M ...] [--no-auto] [--quick]
twobp-bench --memory-model [--out DIR] [--quick] [--world P]
twobp-bench --memory-model --simulate [--out DIR] [--quick]
twobp-bench --sharded [--json PATH] [--quick]
twobp-bench --meta-build [--pretrained] [--world P] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from lightning_twobp.bench.report import write_json
from lightning_twobp.bench.workload import Workload


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="twobp-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_modes(ap)
    _add_options(ap)
    return ap


def _add_modes(ap: argparse.ArgumentParser) -> None:
    """What to measure: one mode per run (the engine's step times when none is given)."""
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--peer", action="store_true", help="side by side with torch.distributed.pipelining")
    mode.add_argument(
        "--trainer", action="store_true", help="through Trainer(strategy=TwoBPStrategy) vs the bare engine"
    )
    mode.add_argument("--split", action="store_true", help="only (B + W) / BW on one block")
    mode.add_argument(
        "--soak", type=int, metavar="N", help="N Trainer steps of the default recipe: does memory stay flat?"
    )
    mode.add_argument(
        "--gpu",
        action="store_true",
        help="one GPU in bf16: a LLaMa-7B layer's F/B/W/BW, the pipeline in one process on the GPU, "
        "the 7B costs simulated on 4 stages (with --quick: toy sizes on the CPU)",
    )
    mode.add_argument(
        "--budget",
        action="store_true",
        help="at 0.5x, 1x, 1.5x, 2x fused 1F1B's peak: the fastest of ours and of torch's that fits, alone each, "
        "and the pick of schedule='auto' run the same way",
    )
    mode.add_argument(
        "--memory-model",
        action="store_true",
        help="predicted (profile + simulate) against measured peak bytes per rank, every schedule, tiny LLaMa "
        "and BERT; with --simulate: the budget tables at p = 4 and 8 on the four paper models' measured costs",
    )
    mode.add_argument(
        "--sharded",
        action="store_true",
        help="pp 2 x dp 2 on 4 processes, data_parallel='shard' against 'replicate': state bytes, peak RSS "
        "growth and step time per rank, one launch per layout, alternated (2 rounds; --quick: 1, toy sizes)",
    )
    mode.add_argument(
        "--meta-build",
        action="store_true",
        help="a model built on every rank's CPU against one built on the meta device: memory per rank after "
        "building, at fit start and at its peak, and fit's time (--world ranks, default 4 here; --quick: toy sizes)",
    )
    mode.add_argument(
        "--eval-sends",
        action="store_true",
        help="forward-only passes (validation): activations sent as tensors after a header against pickled "
        "objects, 2 ranks, alternated (--rounds; --quick: toy sizes, 1 round)",
    )
    mode.add_argument(
        "--paper",
        action="store_true",
        help="the 2BP paper's three questions (throughput, peak memory, scaling) on its four models",
    )


def _add_options(ap: argparse.ArgumentParser) -> None:
    """The modes' options (each help names the modes it applies to)."""
    ap.add_argument(
        "--python-memory",
        action="store_true",
        help="--soak: also trace Python's own allocations (tracemalloc), to tell objects from native growth",
    )
    ap.add_argument("--simulate", action="store_true", help="--memory-model: the simulated budget tables")
    ap.add_argument(
        "--pretrained",
        action="store_true",
        help="--meta-build: start from saved weights, every rank loading the file whole on its CPU against a "
        "meta build reading its stages (TwoBPStrategy(pretrained=...))",
    )
    ap.add_argument(
        "--world", type=int, help="--memory-model: ranks (2P blocks when P > 2; default 2); --meta-build: ranks (4)"
    )
    ap.add_argument("--json", help="write the results as JSON to this path (engine, trainer)")
    ap.add_argument(
        "--out",
        help="--peer: write peer.md, peer.csv and peer.json into this directory; "
        "--paper: paper.md, paper.json, paper-rq*.csv and paper-rq*.png; --budget: budget.md, .csv, .json, .png",
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per configuration (engine, trainer, paper)")
    ap.add_argument(
        "--activation-checkpointing",
        choices=["full", "selective"],
        help="--peer: every block checkpointed on both sides (ours and torch's 1F1B, ZB-H1, ZB-V): forwards per "
        "block, peak bytes per rank, step-time ratio",
    )
    ap.add_argument("--rounds", type=int, default=7, help="--peer: timed rounds (each contender once per round)")
    ap.add_argument("--steps", type=int, default=1, help="--peer: back-to-back training steps per timed sample")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument(
        "--counts",
        type=int,
        nargs="+",
        metavar="M",
        help="--budget: the micro-batch counts each contender runs at (default 8 16, --quick 4); the first is "
        "the baseline's, fused 1F1B's, whose peak the budgets are multiples of",
    )
    ap.add_argument("--no-auto", action="store_true", help='--budget: leave out the picks of schedule="auto"')
    ap.add_argument("--quick", action="store_true", help="a small model and few repeats, to check the harness")
    ap.add_argument("--timelines", metavar="DIR", help="draw each configuration's recorded step as DIR/measured-*.png")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 256, 64], help="--split: tokens per micro-batch")
    ap.add_argument(
        "--batch-w", type=int, default=1, metavar="K", help="--split: one W over K micro-batches (batched W)"
    )
    ap.add_argument(
        "--paper-blocks",
        action="store_true",
        help="--split: (B + W) / BW of the --paper models' layers, thread CPU time (--repeats, --quick)",
    )
    ap.add_argument(
        "--moe",
        action="store_true",
        help="--split: (B + W) / BW of a Hugging Face Mixtral expert block, its W by formula and by autograd",
    )
    ap.add_argument(
        "--full-size",
        action="store_true",
        help="--split --paper-blocks: the layers at a small real model's size (bench.split.FULL_SIZE)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="LABEL",
        help="--peer, --trainer: contenders whose label starts so; --budget: these labels",
    )


def _show(text: str, out: str | None, write: Callable[[str], Iterable[Any]]) -> None:
    """Print a mode's report; with ``--out``, also write its files there, naming each."""
    print(text)
    if out:
        for path in write(out):
            print(f"wrote {path}")


def _show_json(text: str, result: Any, path: str | None) -> None:
    """Print a mode's report; with ``--json``, also write its result there."""
    print(text)
    if path:
        write_json(result, path)


def _split(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.split import bench_paper_blocks, bench_split
    from lightning_twobp.bench.workload import keep_freed_memory

    keep_freed_memory()
    if args.moe:
        from lightning_twobp.bench.split import bench_moe_block

        r = bench_moe_block(args.repeats)
        print(f"Mixtral MoE block, 512 tokens: (B+W)/BW {r['formula']:.3f} with W by formula, {r['autograd']:.3f} by")
        print(f"autograd; held B->W {r['held_formula_mib']:.2f} MiB and {r['held_autograd_mib']:.2f} MiB")
        return
    if args.paper_blocks:
        for name, ratio in bench_paper_blocks(args.repeats, args.quick, args.full_size).items():
            print(f"{name:<8}(B+W)/BW {ratio:.3f}")
        return
    k = args.batch_w
    print(f"{'tokens':>7}{'K':>3}{'BW ms':>9}{'B ms':>9}{'W ms':>9}{'(B+W)/BW':>10}{'W unbatched':>13}")
    for n in args.tokens:
        r = bench_split(n, batch=k)
        ratios = f"{r['median_ratio']:>10.3f}{r['median_ratio_unbatched']:>13.3f}"
        print(f"{n:>7}{k:>3}{r['bw_ms']:>9.2f}{r['b_ms']:>9.2f}{r['w_ms']:>9.2f}{ratios}")


def _soak(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.soak import markdown, soak

    result = soak(args.soak, python=args.python_memory)
    _show_json(markdown(result), result, args.json)


def _gpu(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.gpu import markdown, run_gpu

    result = run_gpu(quick=args.quick, repeats=3 if args.quick else max(args.repeats, 20))
    _show_json(markdown(result), result, args.json)


def _budget(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.budget import markdown, run_budget, write

    counts = tuple(args.counts) if args.counts else (4,) if args.quick else (8, 16)
    only = set(args.only) if args.only else None
    steps = 1 if args.quick else max(args.steps, 5)
    result = run_budget(_workload(args), steps=steps, counts=counts, only=only, auto=not args.no_auto)
    _show(markdown(result), args.out, lambda out: write(result, out))


def _paper(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.paper import markdown, run_paper, write

    result = run_paper(quick=args.quick, repeats=1 if args.quick else args.repeats)
    _show(markdown(result), args.out, lambda out: write(result, out))


def _peer(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.peer import markdown, run_peer, write

    rounds = 1 if args.quick else args.rounds
    if args.activation_checkpointing:
        from lightning_twobp.bench import peer_ac

        ac = peer_ac.run_peer_ac(_workload(args), args.microbatches, args.activation_checkpointing, rounds, args.steps)
        _show(peer_ac.markdown(ac), args.out, lambda out: peer_ac.write(ac, out))
        return
    result = run_peer(_workload(args), args.microbatches, rounds=rounds, warmup=1, steps=args.steps, labels=args.only)
    _show(markdown(result), args.out, lambda out: write(result, out))


def _trainer(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.trainer import bench_trainer

    wl, m = _workload(args), args.microbatches
    repeats = 2 if args.quick else args.repeats
    rows = bench_trainer(wl, m, repeats, args.only)
    print(
        f"tiny LLaMa {wl.layers} x {wl.dim}, batch {wl.batch} x {wl.seq}, m={m}, 2 ranks x 1 thread, "
        f"median of {repeats} alternated steps"
    )
    print(f"{'configuration':<32}{'Trainer s':>11}{'bare s':>9}{'Trainer/bare (median of pairs)':>32}")
    for label, r in rows.items():
        print(f"{label:<32}{r['lightning_step_s']:>11.3f}{r['bare_step_s']:>9.3f}{r['ratio']:>32.3f}")
    if args.json:
        write_json(dict(workload=wl.__dict__, microbatches=m, repeats=repeats, rows=rows), args.json)


def _engine(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.engine import run_engine

    result = run_engine(
        _workload(args), args.microbatches, repeats=1 if args.quick else args.repeats, timelines=args.timelines
    )
    if args.json:
        write_json(result, args.json)


def _memory_model(args: argparse.Namespace) -> None:
    """``--memory-model``: the model against the executor, or (``--simulate``) the budget tables on paper."""
    if args.simulate:
        from lightning_twobp.bench import budget_sim

        sim = budget_sim.run_budget_sim(quick=args.quick)
        _show(budget_sim.markdown(sim), args.out, lambda out: budget_sim.write(sim, out))
        return
    from lightning_twobp.bench.memory_model import markdown, run_memory_model, write

    result = run_memory_model(quick=args.quick, m=4 if args.quick else 8, world=args.world or 2)
    _show(markdown(result), args.out, lambda out: write(result, out))


def _sharded(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.sharded import markdown, run_sharded

    result = run_sharded(steps=3 if args.quick else 8, rounds=1 if args.quick else 2, quick=args.quick)
    _show_json(markdown(result), result, args.json)


def _meta_build(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.meta_build import markdown, run_meta_build

    sizes = dict(width=64, layers=4, rounds=1) if args.quick else dict(rounds=2)
    result = run_meta_build(world=args.world or (2 if args.quick else 4), pretrained=args.pretrained, **sizes)
    _show_json(markdown(result), result, args.json)


def _eval_sends(args: argparse.Namespace) -> None:
    from lightning_twobp.bench.eval_sends import markdown, run_eval_sends

    result = run_eval_sends(quick=args.quick, rounds=1 if args.quick else args.rounds)
    _show_json(markdown(result), result, args.json)


def _workload(args: argparse.Namespace) -> Workload:
    return Workload.quick() if args.quick else Workload()


# The modes, by their flag (mutually exclusive); without one, the engine benchmark.
_MODES: dict[str, Callable[[argparse.Namespace], None]] = {
    "memory_model": _memory_model,
    "sharded": _sharded,
    "meta_build": _meta_build,
    "eval_sends": _eval_sends,
    "split": _split,
    "soak": _soak,
    "gpu": _gpu,
    "budget": _budget,
    "paper": _paper,
    "peer": _peer,
    "trainer": _trainer,
}


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.full_size and not (args.split and args.paper_blocks):
        ap.error("--full-size sizes the layers of --split --paper-blocks: add both")
    run = next((run for flag, run in _MODES.items() if getattr(args, flag)), _engine)
    run(args)
    return 0
