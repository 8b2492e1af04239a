"""Optimizer update subgraphs (SGD, Adam, LAMB) built from plain ONNX ops.

Plain ops rather than ORT's contrib optimizer kernels: they run on every provider (LambOptimizer has no CPU kernel),
never update an input in place (the CPU AdamOptimizer increments its step input in place, docs/engine.md §2.3), and make
the semantics explicit. Every scalar that is the same for all tensors of a parameter group (bias corrections, step
size, decay) is computed once per group as a 0-d tensor, so the per-tensor work is the elementwise update only.

Notation: `g` is the gradient after averaging and clipping. It is never materialised: the caller passes the raw
accumulated gradient `G` and a scalar `coef` (1/k accumulation mean, loss-scale unscaling, clipping), folded into
the moment updates: `m' = b1·m + ((1-b1)·coef)·G`, `v' = b2·v + ((1-b2)·coef²)·G²`.

These append onto a `GraphEditor` rather than map a model to a model; each checks that the group's hyper-parameters
hold what its update reads (`PassPreconditionError` naming the missing ones).

`FUSED_OPTIMIZERS` (`update="fused"`, graph/training.py) writes Adam as ONNX Runtime's fused `AdamOptimizer` kernel, one
node per tensor, each with its own copy of the step count (docs/engine.md §12): the training build only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnx import TensorProto

from ..compile.contract import moment_names
from ..graph.editor import GraphEditor
from ..graph.passes import not_among, require

Scalar = str | float  # a 0-d tensor name, or a Python float folded into constants
CLIP_EPSILON = 1e-6  # as torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6)


@dataclass(frozen=True)
class StepScalars:
    """Per-step 0-d inputs shared by every group: learning rate and the 1-based update number (as double; `count`
    is the int64 input it comes from)."""

    lr: str
    update_count: str
    count: str = ""


@dataclass(frozen=True)
class TensorUpdate:
    """Names of one trainable tensor's state inputs and the outputs holding their updated values."""

    weight: str
    new_weight: str
    moments: tuple[tuple[str, str], ...] = ()  # (state input, updated output) for Moment_1, Moment_2


_ADAM_HYPER = ("alpha", "beta", "lambda", "epsilon", "do_bias_correction", "weight_decay_mode")
_LAMB_HYPER = ("alpha", "beta", "lambda", "epsilon", "do_bias_correction", "ratio_min", "ratio_max")


def append_sgd(
    ed: GraphEditor, weights: list[str], grads: list[str], coef: Scalar, step: StepScalars, hyper: dict
) -> list[TensorUpdate]:
    """SGD: `w' = w - lr·g`."""
    rate = ed.scalar_product([step.lr, coef], "sgd/rate")
    updates = []
    for w, g in zip(weights, grads, strict=True):
        delta = ed.op("Mul", [g, ed.as_tensor(rate)], "sgd/delta")
        updates.append(TensorUpdate(w, ed.op("Sub", [w, delta], f"{w}.new")))
    return updates


def append_adam(
    ed: GraphEditor, weights: list[str], grads: list[str], coef: Scalar, step: StepScalars, hyper: dict
) -> list[TensorUpdate]:
    """Adam with the legacy AdamOptimizer's two weight-decay modes (λ = `lambda`, t = update number).

    `m̂ = m'/bc1`, `v̂ = v'/bc2` with `bc_i = 1 - beta_i^t` (1 when `do_bias_correction` is 0).
    Mode 0 (BEFORE_WEIGHT_UPDATE, torch.optim.AdamW): `w' = w·(1 - lr·λ) - lr·m̂/(√v̂ + ε)`.
    Mode 1 (AFTER_WEIGHT_UPDATE, Hugging Face's old AdamW): `w₁ = w - lr·(√bc2/bc1)·m'/(√v' + ε)`,
    then `w' = w₁·(1 - lr·λ)`.
    """
    require("AdamOptimizer", not_among(_ADAM_HYPER, set(hyper), "hyper-parameters", "the group's"))
    b1, b2, lam, eps = hyper["alpha"], hyper["beta"], hyper["lambda"], hyper["epsilon"]
    bc1, bc2 = _bias_corrections(ed, step, b1, b2, bool(hyper["do_bias_correction"]))
    decay = _decay_factor(ed, step.lr, lam)
    s1 = ed.scalar_product([1.0 - b1, coef], "adam/s1")
    s2 = ed.scalar_product([1.0 - b2, coef, coef], "adam/s2")
    after_update = int(hyper["weight_decay_mode"]) == 1
    if after_update:  # bias correction folded into the step size, ε not corrected (HF order)
        inv_sqrt_bc2: Scalar = 1.0
        step_size = ed.scalar_product([step.lr, _sqrt(ed, bc2), _reciprocal(ed, bc1)], "adam/step_size")
    else:
        inv_sqrt_bc2 = _reciprocal(ed, _sqrt(ed, bc2))
        step_size = ed.scalar_product([step.lr, _reciprocal(ed, bc1)], "adam/step_size")
    updates = []
    for w, g in zip(weights, grads, strict=True):
        m_in, v_in = moment_names(w)
        m_new, v_new = _moments(ed, m_in, v_in, g, b1, b2, s1, s2)
        root = ed.op("Sqrt", [v_new], "adam/sqrt_v")
        if inv_sqrt_bc2 != 1.0:
            root = ed.op("Mul", [root, ed.as_tensor(inv_sqrt_bc2)], "adam/sqrt_v_hat")
        denom = ed.op("Add", [root, ed.constant(eps, hint="adam/eps")], "adam/denom")
        direction = ed.op("Div", [m_new, denom], "adam/direction")
        delta = ed.op("Mul", [direction, ed.as_tensor(step_size)], "adam/delta")
        if after_update:
            w_new = _scale(ed, ed.op("Sub", [w, delta], "adam/w_step"), decay, f"{w}.new")
        else:
            w_new = ed.op("Sub", [_scale(ed, w, decay, "adam/decayed"), delta], f"{w}.new")
        updates.append(TensorUpdate(w, w_new, ((m_in, m_new), (v_in, v_new))))
    return updates


def append_lamb(
    ed: GraphEditor, weights: list[str], grads: list[str], coef: Scalar, step: StepScalars, hyper: dict
) -> list[TensorUpdate]:
    """LAMB: Adam moments, `r = m̂/(√v̂ + ε) + λ·w`, trust ratio `‖w‖/‖r‖` clamped to [ratio_min, ratio_max]
    (1 when either norm is 0), `w' = w - lr·ratio·r`."""
    require("LambOptimizer", not_among(_LAMB_HYPER, set(hyper), "hyper-parameters", "the group's"))
    b1, b2, lam, eps = hyper["alpha"], hyper["beta"], hyper["lambda"], hyper["epsilon"]
    bc1, bc2 = _bias_corrections(ed, step, b1, b2, bool(hyper["do_bias_correction"]))
    s1 = ed.scalar_product([1.0 - b1, coef], "lamb/s1")
    s2 = ed.scalar_product([1.0 - b2, coef, coef], "lamb/s2")
    inv_bc1, inv_bc2 = _reciprocal(ed, bc1), _reciprocal(ed, bc2)
    zero, one = ed.constant(0.0, hint="lamb/zero"), ed.constant(1.0, hint="lamb/one")
    lo = ed.constant(hyper["ratio_min"], hint="lamb/ratio_min")
    hi = ed.constant(hyper["ratio_max"], hint="lamb/ratio_max")
    updates = []
    for w, g in zip(weights, grads, strict=True):
        m_in, v_in = moment_names(w)
        m_new, v_new = _moments(ed, m_in, v_in, g, b1, b2, s1, s2)
        m_hat = _scale(ed, m_new, inv_bc1, "lamb/m_hat")
        v_hat = _scale(ed, v_new, inv_bc2, "lamb/v_hat")
        denom = ed.op("Add", [ed.op("Sqrt", [v_hat], "lamb/sqrt_v"), ed.constant(eps, hint="lamb/eps")], "lamb/denom")
        r = ed.op("Div", [m_hat, denom], "lamb/direction")
        if lam != 0.0:
            r = ed.op("Add", [r, ed.op("Mul", [w, ed.constant(lam, hint="lamb/lambda")], "lamb/decay")], "lamb/r")
        w_norm = _norm(ed, w, "lamb/w_norm")
        r_norm = _norm(ed, r, "lamb/r_norm")
        both_nonzero = ed.op(
            "And",
            [ed.op("Greater", [w_norm, zero], "lamb/w_pos"), ed.op("Greater", [r_norm, zero], "lamb/r_pos")],
            "lamb/norms_pos",
        )
        clamped = ed.op(
            "Max", [ed.op("Min", [ed.op("Div", [w_norm, r_norm], "lamb/trust"), hi], "lamb/min"), lo], "lamb/clamped"
        )
        ratio = ed.op("Where", [both_nonzero, clamped, one], "lamb/ratio")
        rate = ed.op("Mul", [ratio, step.lr], "lamb/rate")
        w_new = ed.op("Sub", [w, ed.op("Mul", [r, rate], "lamb/delta")], f"{w}.new")
        updates.append(TensorUpdate(w, w_new, ((m_in, m_new), (v_in, v_new))))
    return updates


def append_adam_fused(
    ed: GraphEditor, weights: list[str], grads: list[str], coef: Scalar, step: StepScalars, hyper: dict
) -> list[TensorUpdate]:
    """Adam in weight-decay mode 0 as ONNX Runtime's `AdamOptimizer` (com.microsoft), one node per tensor: `g = coef·G`
    materialised (the CPU kernel ignores its loss-scale and gradient-norm inputs), then the kernel's
    `m' = β1·m + (1-β1)·g`, `v' = β2·v + (1-β2)·g²`, `w' = w - lr·(m̂/(√v̂ + ε) + λ·w)` — torch.optim.AdamW's update.

    The kernel writes its step output into its step input's buffer (docs/engine.md §2.3): each node reads its own
    copy, `(count + i) - i` with a distinct constant `i`, which no graph optimisation merges (docs/engine.md §12).
    Mode 1 (decay after the update) has no kernel: such a group gets the plain-op update of `append_adam`."""
    require("AdamOptimizer", not_among(_ADAM_HYPER, set(hyper), "hyper-parameters", "the group's"))
    if int(hyper["weight_decay_mode"]) == 1 or not step.count:
        return append_adam(ed, weights, grads, coef, step, hyper)
    attributes = {
        "alpha": float(hyper["alpha"]),
        "beta": float(hyper["beta"]),
        "lambda": float(hyper["lambda"]),
        "epsilon": float(hyper["epsilon"]),
        "do_bias_correction": int(bool(hyper["do_bias_correction"])),
    }
    updates = []
    for w, g in zip(weights, grads, strict=True):
        m_in, v_in = moment_names(w)
        tag = ed.constant(len(ed.graph.node) + 1, dtype="int64", hint="adam/step_tag")
        own_step = ed.op("Sub", [ed.op("Add", [step.count, tag], "adam/step_tagged"), tag], "adam/step")
        names = [ed.fresh(hint) for hint in ("adam/step_next", f"{m_in}.new", f"{v_in}.new", f"{w}.new")]
        ed.op_outputs(
            "AdamOptimizer",
            [step.lr, own_step, w, _scale(ed, g, coef, "adam/grad"), m_in, v_in],
            "adam/fused",
            names,
            domain="com.microsoft",
            **attributes,
        )
        updates.append(TensorUpdate(w, names[3], ((m_in, names[1]), (v_in, names[2]))))
    return updates


OptimizerAppender = Callable[[GraphEditor, list[str], list[str], Scalar, StepScalars, dict], list[TensorUpdate]]
OPTIMIZERS: dict[str, OptimizerAppender] = {
    "SGDOptimizer": append_sgd,
    "AdamOptimizer": append_adam,
    "LambOptimizer": append_lamb,
}
FUSED_OPTIMIZERS: dict[str, OptimizerAppender] = {**OPTIMIZERS, "AdamOptimizer": append_adam_fused}


def _moments(ed: GraphEditor, m: str, v: str, g: str, b1: float, b2: float, s1: Scalar, s2: Scalar):
    m_new = ed.op(
        "Add", [ed.op("Mul", [m, ed.constant(b1, hint="beta1")], "m_decay"), _scale(ed, g, s1, "m_grad")], f"{m}.new"
    )
    g2 = ed.op("Mul", [g, g], "grad_sq")
    v_new = ed.op(
        "Add", [ed.op("Mul", [v, ed.constant(b2, hint="beta2")], "v_decay"), _scale(ed, g2, s2, "v_grad")], f"{v}.new"
    )
    return m_new, v_new


def _bias_corrections(ed: GraphEditor, step: StepScalars, b1: float, b2: float, enabled: bool):
    """`1 - beta^t` for both betas as float 0-d tensors, computed in double like torch does; 1.0 when disabled."""
    if not enabled:
        return 1.0, 1.0
    corrections = []
    for beta in (b1, b2):
        power = ed.op("Pow", [ed.constant(beta, dtype="float64", hint="beta_d"), step.update_count], "beta_pow_t")
        corr = ed.op("Sub", [ed.constant(1.0, dtype="float64", hint="one_d"), power], "bias_correction_d")
        corrections.append(ed.op("Cast", [corr], "bias_correction", to=TensorProto.FLOAT))
    return corrections[0], corrections[1]


def _decay_factor(ed: GraphEditor, lr: str, lam: float) -> Scalar:
    if lam == 0.0:
        return 1.0
    lr_lambda = ed.op("Mul", [lr, ed.constant(lam, hint="lambda")], "lr_lambda")
    return ed.op("Sub", [ed.constant(1.0, hint="one"), lr_lambda], "decay")


def _scale(ed: GraphEditor, x: str, factor: Scalar, hint: str) -> str:
    if not isinstance(factor, str) and factor == 1.0:
        return x
    return ed.op("Mul", [x, ed.as_tensor(factor)], hint)


def _sqrt(ed: GraphEditor, x: Scalar) -> Scalar:
    return x**0.5 if not isinstance(x, str) else ed.op("Sqrt", [x], "sqrt")


def _reciprocal(ed: GraphEditor, x: Scalar) -> Scalar:
    return 1.0 / x if not isinstance(x, str) else ed.op("Reciprocal", [x], "reciprocal")


def _norm(ed: GraphEditor, x: str, hint: str) -> str:
    return ed.op("Sqrt", [ed.op("ReduceSumSquare", [x], f"{hint}_sq", keepdims=0)], hint)
