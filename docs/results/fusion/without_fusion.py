"""``twobp-train`` with schedule="auto"'s fused variants left out of its search: the baseline of the Trainer
comparison in docs/benchmarks.md ("The Zero Bubble rows fused where their split loses").

    TWOBP_KEEP_FREED_MEMORY=1 python docs/results/fusion/without_fusion.py \
        strategy.schedule=auto strategy.memory_limit=2x1f1b

Lightning starts the second rank by running this file again, so the patch holds on every rank.
"""

import lightning_twobp.schedules.auto as auto
from lightning_twobp.train import main

auto._fusions = lambda candidates: []  # choose() then weighs the split and fused candidates alone, as before

if __name__ == "__main__":
    main()
