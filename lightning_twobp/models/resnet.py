"""ResNet image classifiers as one ``nn.Sequential``: stem, every bottleneck block, head.

torchvision's layout (ResNet v1.5: the stride sits on the 3x3 conv; a 1x1 conv + norm projects the
shortcut where the shape changes) and its initialisation, so ResNet-152 at 1000 classes has exactly
torchvision's 60,192,808 parameters and ResNet-50 its 25,557,032. The Sequential is
``[stem, block, block, ..., head]``: ResNet-152 has 1 + (3 + 8 + 36 + 3) + 1 = 52 elements, each taking and
returning one tensor, so the pipeline may cut between any two blocks. ``depth="tiny"`` is one block per
stage (for CPU tests, e.g. with ``width=8, image_size=64, num_classes=10``; at 32 pixels the last stage
is 1x1, so each norm group sees a handful of values and rounding differences get amplified).

BatchNorm and micro-batches. A pipeline step runs each micro-batch through the stage on its own, so
BatchNorm normalises every micro-batch with that micro-batch's statistics, exactly as gradient
accumulation does: a pipelined step of batch ``B`` in ``m`` micro-batches equals one process trained
with batch ``B / m`` and ``accumulate_grad_batches=m`` (not one process with batch ``B``). The running
statistics update once per micro-batch, in micro-batch order, as they would under that accumulation.
``norm="group"`` (GroupNorm: 32 groups, or fewer where the width does not divide) has no batch statistics,
so the result is independent of the micro-batch count and equals plain full-batch training.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import Unpack, override

from lightning_twobp.models.base import PipelineModule, Training, training_arguments

__all__ = ["Bottleneck", "ResNetClassifier", "ResNetHead", "build_resnet"]

BLOCKS: dict[int | str, list[int]] = {50: [3, 4, 6, 3], 101: [3, 4, 23, 3], 152: [3, 8, 36, 3], "tiny": [1, 1, 1, 1]}
_NORMS = ("batch", "group")


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(math.gcd(32, channels), channels)


class Conv2d(nn.Conv2d):
    """torchvision's ResNet init in the module's own ``reset_parameters`` (its constructor calls it, and
    so does the setup of a model built on the meta device): Kaiming normal, fan out."""

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.weight, mode="fan_out", nonlinearity="relu")


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, plus the shortcut; ``(B, Cin, H, W) ->
    (B, 4 planes, H / stride, W / stride)``."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, norm: str = "batch") -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = _norm(norm, planes)
        self.conv2 = Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = _norm(norm, planes)
        self.conv3 = Conv2d(planes, out, 1, bias=False)
        self.bn3 = _norm(norm, out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(Conv2d(inplanes, out, 1, stride=stride, bias=False), _norm(norm, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNetHead(nn.Module):
    """Global average pool, flatten, fc: ``(B, C, H, W) -> (B, num_classes)`` logits."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_resnet(depth: int | str = 50, num_classes: int = 1000, width: int = 64, norm: str = "batch") -> nn.Sequential:
    """``[stem, blocks..., head]`` with torchvision's layout; ``width`` is the stem's channels (64)."""
    if depth not in BLOCKS:
        raise ValueError(f"depth={depth!r}: choose one of {', '.join(map(repr, BLOCKS))} (bottleneck ResNets)")
    if norm not in _NORMS:
        raise ValueError(f"norm={norm!r}: choose 'batch' (BatchNorm2d) or 'group' (GroupNorm)")
    stem = nn.Sequential(
        Conv2d(3, width, 7, stride=2, padding=3, bias=False),
        _norm(norm, width),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    )
    layers: list[nn.Module] = [stem]
    inplanes = width
    for stage, count in enumerate(BLOCKS[depth]):
        planes = width * 2**stage
        for i in range(count):
            layers.append(Bottleneck(inplanes, planes, stride=2 if stage > 0 and i == 0 else 1, norm=norm))
            inplanes = planes * Bottleneck.expansion
    layers.append(ResNetHead(inplanes, num_classes))  # the fc keeps nn.Linear's default init, as torchvision
    return nn.Sequential(*layers)  # norms start at one and zero: BatchNorm2d's and GroupNorm's own reset


class ResNetClassifier(PipelineModule):
    """A ResNet classifier as a LightningModule; batches are ``(images (B, 3, H, W) float, labels (B,) int64)``.

    Logs ``{train,val,test}_loss`` (cross-entropy) and ``_acc``. Accuracy is the micro average (correct
    / samples): averaged over micro-batches weighted by their sizes, as the pipeline does, it equals the
    whole batch's accuracy (a macro average over classes would not). The metric objects hold no
    parameters and sit outside the Sequential.
    ``**training``: the optimizer and seed arguments, :class:`~lightning_twobp.models.base.Training`
    (``lr=1e-3`` by default).
    """

    def __init__(
        self,
        depth: int | str = 50,
        num_classes: int = 1000,
        width: int = 64,
        image_size: int = 224,
        norm: str = "batch",
        **training: Unpack[Training],
    ) -> None:
        training = training_arguments(training, lr=1e-3)  # all five, for save_hyperparameters()
        super().__init__(**training)
        self.save_hyperparameters()
        self.image_size = image_size
        self.layers = build_resnet(depth, num_classes, width, norm)
        with torch.device("cpu"):  # metrics hold no weights: made even in a build on the meta device
            self.train_acc = MulticlassAccuracy(num_classes, average="micro")
            self.val_acc = MulticlassAccuracy(num_classes, average="micro")
            self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    @override
    def compute_loss(self, output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(output.float(), batch[1])  # (B, classes) vs (B,)

    @override
    def log_metrics(self, stage: str, output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        metric = getattr(self, f"{stage}_acc")
        # The value of this batch (a tensor), not the metric object: strategy='twobp' averages tensors
        # over micro-batches; Lightning averages them over the epoch for val/test.
        self.log(f"{stage}_acc", metric(output.detach(), batch[1]), prog_bar=True)

    @override
    def sample_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 3, self.image_size, self.image_size, device=self._parameters_device)
