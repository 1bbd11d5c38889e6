"""Private torch, Lightning and torchmetrics names are reached through two doors only:
``lightning_twobp/private.py`` and autograd's ``lightning_twobp/engine/graph.py``. A private import or a
known private attribute anywhere else fails here, and every name the doors use must still exist in the
installed releases (an upgrade that renames one fails here, by name)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import lightning_twobp
from lightning_twobp.private import GUARDED

PACKAGE = Path(lightning_twobp.__file__).resolve().parent
DOORS = {"private.py", "engine/graph.py"}
# Private attributes of torch's, Lightning's or torchmetrics' objects (our own privates are ours).
FOREIGN = {
    "_C",
    "_version",
    "_backward_hooks",
    "_post_accumulate_grad_hooks",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_make_wrapper_subclass",
    "_data_source",
    "_data_fetcher",
    "_combined_loader",
    "_accelerator_connector",
    "_layer_sync",
    "_forward_cache",
    "_update_count",
    "_reduce_states",
    "_collect_rng_states",
    "_set_rng_states",
    "_pytree",
    "_python_dispatch",
    "_disabled_torch_function_impl",
    "_check_inf_per_device",
    "_skip_backward",
    "_op_dispatcher",
    "_custom_op_handlers",
}
# Where a private name cannot move behind a door, and why (each guarded below).
ALLOWED = {
    # our precision plugin mixin overrides Lightning's step hook: an override stays in its class
    ("lightning/grads.py", "_after_closure"),
    # our GradScaler overrides the inf check torch's step calls for an optimizer that unscales itself
    ("lightning/grads.py", "_check_inf_per_device"),
}


def _modules() -> list[tuple[str, ast.AST]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in DOORS:
            out.append((rel, ast.parse(path.read_text(), filename=rel)))
    return out


def _private_module(name: str) -> bool:
    return any(part.startswith("_") and part != "__future__" for part in name.split("."))


def _findings(rel: str, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{rel}:{node.lineno} import {a.name}" for a in node.names if _private_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [a.name for a in node.names if a.name.startswith("_")]
            ours = node.module.startswith("lightning_twobp")  # between our modules: a private name is not shared
            if names or (not ours and _private_module(node.module)):
                found.append(f"{rel}:{node.lineno} from {node.module} import {names or '...'}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in FOREIGN | {"_after_closure"}
            and (rel, node.attr) not in ALLOWED
        ):
            found.append(f"{rel}:{node.lineno} .{node.attr}")
    return found


def test_private_names_only_behind_the_doors():
    found = [f for rel, tree in _modules() for f in _findings(rel, tree)]
    assert not found, "private torch/Lightning/torchmetrics names outside lightning_twobp/private.py:\n" + "\n".join(
        found
    )


def test_the_scan_sees_a_private_use():
    # the scan itself must fail on what it is there to catch
    tree = ast.parse(
        "from torch.utils import _pytree\nimport torch._C\nx = t._version\nfrom lightning_twobp.bench.peer import _f\n"
    )
    assert len(_findings("example.py", tree)) == 4


def _resolve(owner: str) -> object:
    parts = owner.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(owner)


@pytest.mark.parametrize(("owner", "name"), GUARDED, ids=[f"{o}.{n}" for o, n in GUARDED])
def test_each_private_name_still_exists(owner, name):
    assert hasattr(_resolve(owner), name), f"{owner}.{name} is gone: update lightning_twobp/private.py"


def test_the_private_instance_attributes_still_exist():
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torchmetrics.aggregation import SumMetric

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    linear = torch.nn.Linear(1, 1)
    assert isinstance(linear._forward_hooks, dict) and isinstance(linear._forward_pre_hooks, dict)
    from lightning_twobp.private import module_copy

    seen: list[int] = []
    holder = torch.nn.Sequential(torch.nn.Linear(1, 1))
    holder.trainer_like = object()  # shared, not copied
    holder[0].register_forward_pre_hook(lambda *_: seen.append(1))
    holder.register_forward_hook(lambda *_: seen.append(2), with_kwargs=True)
    memo = {id(t): torch.nn.Parameter(torch.zeros_like(t)) for t in holder.parameters()}
    twin = module_copy(holder, memo)
    twin(torch.ones(1))
    assert not seen and twin.trainer_like is holder.trainer_like and twin[0] is not holder[0]
    assert twin[0].weight is memo[id(holder[0].weight)] and holder[0].weight.abs().sum() > 0
    holder(torch.ones(1))
    assert seen == [1, 2]  # the original's hooks stay
    # a method bound to the module in its own __dict__ (a patched `_pos_embed`) runs on the copy's tensors
    import types

    holder[0].scaled = types.MethodType(lambda self, x: self.weight * x, holder[0])
    twin = module_copy(holder, memo)
    assert twin[0].scaled.__self__ is twin[0] and torch.equal(twin[0].scaled(torch.ones(1)), torch.zeros(1, 1))
    assert hasattr(trainer.fit_loop, "_data_source")
    loops = (trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
    assert all(hasattr(loop, "_data_source") for loop in loops)
    assert hasattr(trainer.fit_loop, "_data_fetcher") and hasattr(trainer.fit_loop, "_combined_loader")
    assert hasattr(trainer._accelerator_connector, "use_distributed_sampler")
    metric = SumMetric()
    assert hasattr(metric, "_forward_cache") and hasattr(metric, "_update_count")
    from lightning_twobp.private import dtensor_op_handlers  # shard_reads.py adds aten.equal's handler to it

    assert isinstance(dtensor_op_handlers(), dict)
    assert hasattr(DDPStrategy(), "_timeout")  # TwoBPStrategy reads its base's process-group timeout
    from lightning_twobp.private import tensor_hooks  # the parameter-hook refusal counts through it

    w = torch.nn.Parameter(torch.zeros(1))
    assert tensor_hooks(w) == ([], [])
    w.register_hook(lambda g: g)
    w.register_post_accumulate_grad_hook(lambda q: None)
    assert [len(h) for h in tensor_hooks(w)] == [1, 1]
