"""Reference optimizers written directly from their formulas, for the parity tests.

`torch.optim.AdamW` / `torch.optim.SGD` are used wherever they implement the legacy semantics; these cover what
torch does not ship: Adam with the decay applied after the update (Hugging Face's old AdamW order), Adam without
bias correction, and LAMB.
"""

from __future__ import annotations

import math

import torch


class ReferenceAdam:
    """Adam per the legacy AdamOptimizer: mode 0 = torch AdamW; mode 1 = decay after the update, bias correction
    folded into the step size, epsilon not corrected."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, mode=0, bias_correction=True
    ) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd, self.mode, self.bias_correction = (
            lr,
            betas,
            eps,
            weight_decay,
            mode,
            bias_correction,
        )
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        self.t += 1
        b1, b2 = self.betas
        bc1 = 1 - b1**self.t if self.bias_correction else 1.0
        bc2 = 1 - b2**self.t if self.bias_correction else 1.0
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            g = p.grad
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            if self.mode == 0:
                p.mul_(1 - lr * self.wd)
                p.sub_(lr * (m / bc1) / ((v / bc2).sqrt() + self.eps))
            else:
                p.sub_(lr * math.sqrt(bc2) / bc1 * m / (v.sqrt() + self.eps))
                p.mul_(1 - lr * self.wd)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


class ReferenceLamb:
    """LAMB: Adam moments, r = m̂/(√v̂+ε) + λw, trust ratio ‖w‖/‖r‖ clamped (1 if a norm is 0), w -= lr·ratio·r."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.0,
        ratio_min=-math.inf,
        ratio_max=math.inf,
        bias_correction=False,
    ) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.ratio_min, self.ratio_max, self.bias_correction = ratio_min, ratio_max, bias_correction
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        self.t += 1
        b1, b2 = self.betas
        bc1 = 1 - b1**self.t if self.bias_correction else 1.0
        bc2 = 1 - b2**self.t if self.bias_correction else 1.0
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            g = p.grad
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            r = (m / bc1) / ((v / bc2).sqrt() + self.eps) + self.wd * p
            w_norm, r_norm = p.norm(), r.norm()
            ratio = (w_norm / r_norm).clamp(self.ratio_min, self.ratio_max) if w_norm > 0 and r_norm > 0 else 1.0
            p.sub_(lr * ratio * r)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
