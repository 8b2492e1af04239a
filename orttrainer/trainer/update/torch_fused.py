"""The optimizer update of a gradient-only training graph (`update="torch"`), run by torch in place on the session's
state buffers.

The session's weights and moments are ONNX Runtime `OrtValue`s; torch sees the same memory through DLPack
(docs/engine.md §3.2), so updating the torch views in place updates the state the next run feeds — no copy and no
new allocation per step. The update starts only after ONNX Runtime has finished the run, so no kernel still reads
a weight while it changes (the hazard of binding outputs onto inputs, docs/engine.md §3.2, does not arise).

The semantics are those of the graph update (update/in_graph.py, graph/training.py), term by term:
- `coef = 1/gradient_divisor` (divided by the loss scale under mixed precision) turns the gradient sums `G` into the
  mean gradient of the unscaled loss; it reaches the kernels as `grad_scale = 1/coef`, never as a pass over `G`.
- The finite check (mixed precision) and clipping use the norm of all gradients, computed as
  `torch.nn.utils.clip_grad_norm_` does (the norm of the per-tensor norms); a non-finite norm skips the update.
- SGD: `w -= lr·coef·G` (one foreach add).
- Adam: `torch._fused_adamw_` (weight-decay mode 0, torch.optim.AdamW's order). Without bias correction the kernel
  gets the step count `inf`, where `1 - β^t` is exactly 1 for `0 ≤ β < 1`. Mode 1 (decay after the update, ε not
  corrected) is `torch._fused_adam_` with `ε/√(1-β2^t)` — the same quotient — followed by `w *= 1 - lr·λ`.
- LAMB: foreach ops (torch has no LAMB kernel): Adam moments, `r = m̂/(√v̂ + ε) + λw`, per-tensor trust ratio
  `‖w‖/‖r‖` clamped as the graph does (`max(min(ratio, ratio_max), ratio_min)`, 1 when a norm is 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ..compile.contract import OutsideUpdate, ParamGroup, moment_names
from .in_graph import CLIP_EPSILON

View = Callable[[str], torch.Tensor]  # state name -> a torch tensor sharing the state's memory


def supports(optimizer_name: str, groups: list[ParamGroup]) -> bool:
    """Whether the torch update computes exactly the graph's update for these groups: everything but an Adam group
    without bias correction whose beta is 1 or more (`1 - β^∞` is not 1 there; the graph path serves it)."""
    if optimizer_name != "AdamOptimizer":
        return True
    return all(
        bool(g.hyper["do_bias_correction"]) or (g.hyper["alpha"] < 1.0 and g.hyper["beta"] < 1.0) for g in groups
    )


class TorchOptimizer:
    """Applies `update` to the state tensors given by `view` (module docstring)."""

    def __init__(self, update: OutsideUpdate, view: View) -> None:
        self.update, self._view = update, view
        updated = set(update.updated)
        self._groups = [(g.hyper, [p for p in g.params if p in updated]) for g in update.groups]
        self._moment_names = {p: moment_names(p) for p in update.updated}
        self._step = {"SGDOptimizer": self._sgd, "AdamOptimizer": self._adam, "LambOptimizer": self._lamb}[
            update.optimizer_name
        ]

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], lr: float, update_count: int, loss_scale: float | None) -> bool:
        """Update the weights (and moments) in place from the gradient sums `grads` (every trainable tensor's);
        returns False, changing nothing, when the check for non-finite gradients fails."""
        lr = float(np.float32(lr))  # as the graph's float32 input: an lr given as float32 or float64 acts the same
        coef = 1.0 / self.update.gradient_divisor
        if self.update.check_finite:
            coef /= float(np.float32(loss_scale if loss_scale is not None else 1.0))
        factor = 1.0
        if self.update.clip or self.update.check_finite:
            norm = _global_norm(list(grads.values()))
            if self.update.check_finite and not math.isfinite(norm):
                return False
            if self.update.clip:
                factor = norm * coef  # the norm of the mean gradient; per group: min(1, max_norm / (norm + 1e-6))
        for hyper, params in self._groups:
            if params:
                group_coef = coef
                if self.update.clip:
                    group_coef = coef * min(1.0, float(hyper["max_norm_clip"]) / (factor + CLIP_EPSILON))
                self._step(hyper, params, [grads[p] for p in params], lr, update_count, group_coef)
        return True

    def _sgd(self, hyper: dict, params: list[str], grads: list[torch.Tensor], lr: float, t: int, coef: float) -> None:
        torch._foreach_add_(self._tensors(params), grads, alpha=-(lr * coef))

    def _adam(self, hyper: dict, params: list[str], grads: list[torch.Tensor], lr: float, t: int, coef: float) -> None:
        weights = self._tensors(params)
        m, v = self._moments(params)
        b1, b2, lam, eps = (float(hyper[k]) for k in ("alpha", "beta", "lambda", "epsilon"))
        corrected = bool(hyper["do_bias_correction"])
        device = weights[0].device
        steps = [torch.tensor(float(t) if corrected else math.inf, device=device)] * len(params)
        scale = None if coef == 1.0 else torch.tensor(1.0 / coef, device=device)
        after_update = int(hyper["weight_decay_mode"]) == 1
        fused = torch._fused_adam_ if after_update else torch._fused_adamw_
        if after_update:  # eps/√bc2 puts ε outside the bias correction, as the legacy mode 1 does
            eps /= math.sqrt(1.0 - b2**t if corrected else 1.0)
        fused(
            weights,
            grads,
            m,
            v,
            [],
            steps,
            lr=lr,
            beta1=b1,
            beta2=b2,
            weight_decay=0.0 if after_update else lam,
            eps=eps,
            amsgrad=False,
            maximize=False,
            grad_scale=scale,
        )
        if after_update and lam != 0.0:
            torch._foreach_mul_(weights, 1.0 - lr * lam)

    def _lamb(self, hyper: dict, params: list[str], grads: list[torch.Tensor], lr: float, t: int, coef: float) -> None:
        weights = self._tensors(params)
        m, v = self._moments(params)
        b1, b2, lam, eps = (float(hyper[k]) for k in ("alpha", "beta", "lambda", "epsilon"))
        corrected = bool(hyper["do_bias_correction"])
        bc1, bc2 = (1.0 - b1**t, 1.0 - b2**t) if corrected else (1.0, 1.0)
        torch._foreach_mul_(m, b1)
        torch._foreach_add_(m, grads, alpha=(1.0 - b1) * coef)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=(1.0 - b2) * coef * coef)
        denom = torch._foreach_sqrt(torch._foreach_mul(v, 1.0 / bc2))
        torch._foreach_add_(denom, eps)
        r = torch._foreach_mul(m, 1.0 / bc1)
        torch._foreach_div_(r, denom)
        if lam != 0.0:
            torch._foreach_add_(r, weights, alpha=lam)
        w_norm, r_norm = torch.stack(torch._foreach_norm(weights)), torch.stack(torch._foreach_norm(r))
        ratio = torch.maximum(
            torch.minimum(w_norm / r_norm, _full(float(hyper["ratio_max"]), w_norm)),
            _full(float(hyper["ratio_min"]), w_norm),
        )
        ratio = torch.where((w_norm > 0) & (r_norm > 0), ratio, torch.ones_like(ratio))
        torch._foreach_mul_(r, [-lr * float(x) for x in ratio.tolist()])
        torch._foreach_add_(weights, r)

    def _tensors(self, names: list[str]) -> list[torch.Tensor]:
        return [self._view(n) for n in names]

    def _moments(self, params: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        names = [self._moment_names[p] for p in params]
        return self._tensors([m for m, _ in names]), self._tensors([v for _, v in names])


def _global_norm(grads: list[torch.Tensor]) -> float:
    """The 2-norm of all gradients together, as torch.nn.utils.clip_grad_norm_ computes it (0 for none)."""
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))


def _full(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, value)
