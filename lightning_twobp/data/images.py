"""Image classification data from local files, without torchvision.

``ImageTensors``: a ``.pt`` file ``{"images": (N, 3, H, W) uint8 or float, "labels": (N,) long}``.
``ImageFolder``: ``root/<class>/<image>.jpg|png``, classes in sorted order, read with Pillow.

Both give ``(image float32 (3, H, W), label long ())``. uint8 pixels (and every image file) are scaled
to [0, 1] and normalised with the ImageNet mean/std, as ResNets expect; float images in a tensors file
are taken as already preprocessed.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_EXTENSIONS", "ImageFolder", "ImageTensors"]

IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


def _normalise_uint8(img: torch.Tensor) -> torch.Tensor:
    return (img.float() / 255 - IMAGENET_MEAN) / IMAGENET_STD


def _resize(img: torch.Tensor, image_size: int) -> torch.Tensor:
    if img.shape[-2:] == (image_size, image_size):
        return img
    return F.interpolate(
        img[None], size=(image_size, image_size), mode="bilinear", antialias=True, align_corners=False
    )[0]


class ImageTensors(Dataset):
    """Images and labels stored as tensors in one ``.pt`` file (loaded whole, with
    ``weights_only=True``, so the file cannot run code). With ``image_size`` the images are resized on
    access; with ``num_classes`` the labels are checked to be in range."""

    def __init__(self, path: str | os.PathLike, image_size: int | None = None, num_classes: int | None = None) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"image tensors file {path} does not exist: save one with "
                f"torch.save({{'images': uint8 (N, 3, H, W), 'labels': long (N,)}}, '{path.name}')"
            )
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a corrupt or foreign file
            raise ValueError(f"{path} could not be loaded with torch.load ({type(e).__name__}: {e})") from e
        if not isinstance(obj, dict) or not {"images", "labels"} <= obj.keys():
            found = sorted(obj.keys()) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(
                f"{path.name} must hold a dict with keys 'images' (N, 3, H, W) and 'labels' (N,); found {found}"
            )
        images, labels = obj["images"], obj["labels"]
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"{path.name}: 'images' must be (N, 3, H, W), channels first; got {shape}")
        if images.dtype != torch.uint8 and not images.is_floating_point():
            raise ValueError(f"{path.name}: 'images' must be uint8 (0..255) or float; got {images.dtype}")
        integer = isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.dtype != torch.bool
        if not integer or labels.dim() != 1:
            desc = (
                f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, torch.Tensor) else type(labels).__name__
            )
            raise ValueError(f"{path.name}: 'labels' must be an integer tensor (N,); got {desc}")
        if len(labels) != len(images):
            raise ValueError(f"{path.name} holds {len(images):,} images but {len(labels):,} labels: they must match")
        if num_classes is not None and len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
            raise ValueError(
                f"{path.name} has labels in [{int(labels.min())}, {int(labels.max())}], outside num_classes "
                f"{num_classes}: set num_classes >= {int(labels.max()) + 1} (labels start at 0)"
            )
        self.images, self.labels, self.image_size = images, labels.long(), image_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.images[i]
        img = _normalise_uint8(img) if img.dtype == torch.uint8 else img.float()
        if self.image_size is not None:
            img = _resize(img, self.image_size)
        return img, self.labels[i]


class ImageFolder(Dataset):
    """``root/<class>/<image>``: one subdirectory per class (sorted: the i-th is label i), jpg/png
    files in each. Images are converted to RGB, resized (shorter side to ``image_size``, then a
    centre crop to ``image_size`` square, keeping the aspect ratio) and normalised."""

    def __init__(self, root: str | os.PathLike, image_size: int) -> None:
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"image folder {root} does not exist: it should hold one subdirectory per class")
        self.classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not self.classes:
            raise ValueError(f"image folder {root} has no class subdirectories: put the images of class c in {root}/c/")
        self.samples: list[tuple[Path, int]] = []
        for label, c in enumerate(self.classes):
            files = sorted(f for f in (root / c).iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file())
            if not files:
                raise ValueError(
                    f"class folder {root / c} holds no images ({', '.join(IMAGE_EXTENSIONS)}): add some or remove "
                    f"the folder"
                )
            self.samples += [(f, label) for f in files]
        self.root, self.image_size = root, image_size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image  # Pillow comes with matplotlib; imported here so the package imports without it

        path, label = self.samples[i]
        try:
            with Image.open(path) as im:
                im = im.convert("RGB")
                s = self.image_size
                scale = s / min(im.size)
                w, h = max(s, round(im.width * scale)), max(s, round(im.height * scale))
                im = im.resize((w, h), Image.Resampling.BILINEAR)
                left, top = (w - s) // 2, (h - s) // 2
                im = im.crop((left, top, left + s, top + s))
                arr = np.asarray(im, dtype=np.uint8)
        except (OSError, ValueError) as e:  # PIL.UnidentifiedImageError is an OSError
            raise ValueError(f"cannot read image {path} ({type(e).__name__}: {e}): replace or delete the file") from e
        return _normalise_uint8(torch.from_numpy(arr.copy()).permute(2, 0, 1)), torch.tensor(label)
