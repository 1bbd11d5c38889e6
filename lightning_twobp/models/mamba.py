"""Mamba (selective state-space) language model as one ``nn.Sequential``: embedding, N blocks, norm + head.

Each block is ``x + mixer(RMSNorm(x))`` with the Mamba-1 mixer of Gu & Dao (2023): in_proj to the two
branches ``u`` and ``z``; a depthwise causal conv1d and SiLU on ``u``; ``x_proj`` to the step size's
low-rank input and the input-dependent ``B`` and ``C``; ``dt_proj`` and softplus to the step ``delta``;
the selective scan ``h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t``, ``y_t = C_t h_t + D u_t``; the gate
``y * SiLU(z)``; out_proj. Initialisation follows the reference ``mamba_ssm`` (S4D-real ``A``, ``dt``
log-uniform in [1e-3, 1e-1], out_proj scaled by ``1 / sqrt(n_layers)``).

The scan is plain PyTorch, differentiated by autograd (so the split backward sees an ordinary graph):
chunks of ``scan_chunk`` steps are scanned in parallel (a log-depth Hillis-Steele scan over the affine
maps ``h -> a h + b``, which only multiplies and adds, so nothing can overflow), and the state is carried
from chunk to chunk. ``scan_chunk=1`` is the plain sequential recurrence; larger chunks take fewer Python
steps for more saved activations: per block and sample, autograd keeps about 4 (chunk 1), 7 (chunk 4)
or 11 (chunk 16) tensors of shape ``(L, expand * dim, d_state)``, i.e. about 1 GiB (chunk 1) to 2.9 GiB
(chunk 16) per block for one 1024-token sequence at Mamba-1.4B's size in fp32. That is fine for small
models; at paper size use the fused kernel: where ``mamba_ssm`` is installed and the tensors are on
CUDA, its ``selective_scan_fn`` (which recomputes the states in its backward) runs instead (optional;
this package never requires or installs it).

The 2BP paper's Mamba-1.4B: ``dim=2048, n_layers=48, d_state=16, expand=2, d_conv=4``. The reference
checkpoint pads the GPT-NeoX vocabulary of 50280 to 50288 (a multiple of 8); pass ``vocab_size=50288``
for the same embedding. The reference ties the LM head to the embedding (1,372,194,816 parameters); a
tied weight cannot span the first and last pipeline stages, so here the head has its own
``vocab_size x dim`` weight and the model has 1,475,184,640 parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Unpack

from lightning_twobp.models.base import LanguageModel, Training, training_arguments
from lightning_twobp.models.llama import Linear as NormalLinear
from lightning_twobp.models.llama import RMSNorm

__all__ = ["MambaBlock", "MambaConfig", "MambaHead", "MambaLM", "MambaMixer", "build_mamba", "selective_scan"]

try:  # the fused CUDA kernel, when the user has it; this package never installs it
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as _fused_scan
except Exception:  # ImportError, or a build that fails to load its extension
    _fused_scan = None


def _scan_chunk(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of the maps ``h -> a_t h + b_t`` along dim 1: returns their compositions from the
    chunk's start, ``(prod a_1..a_t, h_t from h_0 = 0)``, in ceil(log2 T) vectorised rounds."""
    t, shift = a.shape[1], 1
    while shift < t:
        # element i absorbs element i - shift (the earlier map runs first): (a, b) <- (a a', a b' + b)
        b = torch.cat((b[:, :shift], a[:, shift:] * b[:, :-shift] + b[:, shift:]), dim=1)
        a = torch.cat((a[:, :shift], a[:, shift:] * a[:, :-shift]), dim=1)
        shift *= 2
    return a, b


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk: int = 16,
) -> torch.Tensor:
    """The selective scan in PyTorch. ``u, delta``: (B, L, Di); ``A``: (Di, N); ``B, C``: (B, L, N);
    ``D``: (Di,). Returns ``y``: (B, L, Di) with ``y_t = C_t h_t + D u_t``."""
    if chunk < 1:
        raise ValueError(f"scan chunk {chunk} must be >= 1 (1: the sequential recurrence)")
    dA = torch.exp(delta.unsqueeze(-1) * A)  # (B, L, Di, N): the decay of each step
    dBu = (delta * u).unsqueeze(-1) * B.unsqueeze(2)  # (B, L, Di, N): what each step writes
    h = None  # (B, Di, N): the state at the end of the previous chunk
    ys = []
    for s in range(0, u.shape[1], chunk):
        a, states = _scan_chunk(dA[:, s : s + chunk], dBu[:, s : s + chunk])  # (B, c, Di, N) each
        if h is not None:
            states = states + a * h.unsqueeze(1)  # the carried state, decayed by the chunk's prefix
        h = states[:, -1]
        ys.append(torch.einsum("bldn,bln->bld", states, C[:, s : s + chunk]))
    return torch.cat(ys, dim=1) + u * D


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba-1 mixer's hyper-parameters, with the reference's defaults: their one place (the mixer,
    the block, :func:`build_mamba` and :class:`MambaLM` read them here)."""

    d_state: int = 16  # N, the state size of each inner channel
    d_conv: int = 4  # the causal conv1d's width
    expand: int = 2  # the inner width is expand * dim
    dt_rank: int | None = None  # None: the reference's "auto", ceil(dim / 16)
    scan_chunk: int = 16  # steps scanned in parallel (module docstring); 1: the sequential recurrence
    dt_min: float = 1e-3  # the initial step sizes are log-uniform in [dt_min, dt_max]
    dt_max: float = 1e-1


class MambaMixer(nn.Module):
    """The Mamba-1 mixer, ``(B, L, C) -> (B, L, C)``, with the reference's parameter layout and init;
    ``n_layers`` (of the whole model) scales out_proj's init."""

    def __init__(self, dim: int, cfg: MambaConfig = MambaConfig(), n_layers: int = 1) -> None:
        super().__init__()
        d_inner, d_state, d_conv = cfg.expand * dim, cfg.d_state, cfg.d_conv
        self.d_state, self.dt_rank, self.scan_chunk = d_state, cfg.dt_rank or math.ceil(dim / 16), cfg.scan_chunk
        self.in_proj = nn.Linear(dim, 2 * d_inner, bias=False)
        # Depthwise; padded on both sides and cut to the first L outputs, so step t sees t-d_conv+1..t.
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner)
        self.A_log = nn.Parameter(torch.empty(d_inner, d_state))
        self.D = nn.Parameter(torch.empty(d_inner))
        # as the reference: not decayed (a flag of ours on the Parameter, read by configure_optimizers)
        self.A_log._no_weight_decay = self.D._no_weight_decay = True  # type: ignore[attr-defined]
        self.out_proj = nn.Linear(d_inner, dim, bias=False)
        self.dt_range, self.n_layers = (cfg.dt_min, cfg.dt_max), n_layers
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The reference's init, after the projections' own (the constructor's order, which a model built
        on the meta device replays at setup): S4D-real A, unit D, dt_proj for log-uniform steps, out_proj
        scaled by the depth."""
        d_inner, d_state = self.A_log.shape
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)))
            nn.init.ones_(self.D)
            std = self.dt_rank**-0.5
            nn.init.uniform_(self.dt_proj.weight, -std, std)
            # softplus(bias) = dt, log-uniform in [dt_min, dt_max]: the inverse softplus of a sample
            lo, hi = (math.log(v) for v in self.dt_range)
            dt = torch.exp(torch.rand(d_inner) * (hi - lo) + lo)
            dt = dt.clamp(min=1e-4)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            # GPT-2's scaling of the residual branch's last projection by the depth
            nn.init.kaiming_uniform_(self.out_proj.weight, a=math.sqrt(5))
            self.out_proj.weight.div_(math.sqrt(self.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (B, L, Di) each
        u = F.silu(self.conv1d(u.transpose(1, 2))[..., :t]).transpose(1, 2)  # (B, L, Di), causal
        dt, B, C = self.x_proj(u).split((self.dt_rank, self.d_state, self.d_state), dim=-1)  # (B, L, R|N|N)
        delta = F.softplus(self.dt_proj(dt))  # (B, L, Di), > 0
        A = -torch.exp(self.A_log.float())  # (Di, N), < 0: every state decays
        if _fused_scan is not None and u.is_cuda:
            y = _fused_scan(
                u.transpose(1, 2).contiguous(),
                delta.transpose(1, 2).contiguous(),
                A,
                B.transpose(1, 2).contiguous(),
                C.transpose(1, 2).contiguous(),
                self.D.float(),
            ).transpose(1, 2)
        else:
            y = selective_scan(u, delta, A, B, C, self.D, self.scan_chunk)
        return self.out_proj(y * F.silu(z))


class MambaBlock(nn.Module):
    """``x + mixer(RMSNorm(x))``, ``(B, L, C) -> (B, L, C)``."""

    def __init__(self, dim: int, cfg: MambaConfig = MambaConfig(), n_layers: int = 1) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.mixer = MambaMixer(dim, cfg, n_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class Embedding(nn.Embedding):
    """Token ids (B, L) -> (B, L, C); a separate class so partitioners can name it. The reference's
    N(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class MambaHead(nn.Module):
    """Final RMSNorm and the LM head, ``(B, L, C) -> (B, L, V)``; the head is untied (module docstring)."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.out = NormalLinear(dim, vocab_size)  # N(0, 0.02): as its tied copy of the embedding would start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_mamba(
    vocab_size: int, dim: int, n_layers: int, mixer: MambaConfig | None = None, **options: Any
) -> nn.Sequential:
    """Embedding, ``n_layers`` blocks and the head as one Sequential of ``n_layers + 2`` layers. The blocks'
    hyper-parameters are ``mixer`` (default: :class:`MambaConfig`'s) with any of its fields given as a
    keyword (``d_state=8``) in their place."""
    cfg = replace(mixer or MambaConfig(), **options)  # an unknown keyword: MambaConfig's TypeError names it
    embedding = Embedding(vocab_size, dim)
    blocks = [MambaBlock(dim, cfg, n_layers) for _ in range(n_layers)]
    return nn.Sequential(embedding, *blocks, MambaHead(dim, vocab_size))


class MambaLM(LanguageModel):
    """A Mamba language model as a LightningModule (next-token cross-entropy).

    Batches are ``(ids, targets)``, both ``(B, L)`` int64. The model takes any length; ``max_seq_len``
    only sizes :meth:`sample_input`. ``dt_rank=None`` is the reference's "auto", ``ceil(dim / 16)``.
    ``**training``: the optimizer and seed arguments, :class:`~lightning_twobp.models.base.Training`
    (``lr=1e-3`` by default).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        dim: int = 128,
        n_layers: int = 4,
        d_state: int = MambaConfig.d_state,
        d_conv: int = MambaConfig.d_conv,
        expand: int = MambaConfig.expand,
        dt_rank: int | None = MambaConfig.dt_rank,
        max_seq_len: int = 64,
        scan_chunk: int = MambaConfig.scan_chunk,
        **training: Unpack[Training],
    ) -> None:
        training = training_arguments(training, lr=1e-3)  # all five, for save_hyperparameters()
        super().__init__(**training)
        self.save_hyperparameters()
        self.max_seq_len = max_seq_len
        mixer = MambaConfig(d_state=d_state, d_conv=d_conv, expand=expand, dt_rank=dt_rank, scan_chunk=scan_chunk)
        self.layers = build_mamba(vocab_size, dim, n_layers, mixer)
