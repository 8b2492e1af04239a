"""Optimizer configurations: what the training graph's optimizer nodes are built from.

These objects are not optimizers. They hold the name of the ONNX Runtime optimizer kernel, the default
hyper-parameters and optional per-parameter groups (the PyTorch "param group" idea, keyed by parameter *name*).
The trainer reads them once, when it builds the training graph.

Behaviour follows the legacy ``onnxruntime.training.optim.config`` of release 1.13.1, error messages included,
except that checks raise ``AssertionError`` explicitly so they survive ``python -O``.
"""

from __future__ import annotations

from enum import IntEnum, unique
from typing import Any

from .._require import require as _require

__all__ = ["_OptimizerConfig", "AdamConfig", "LambConfig", "SGDConfig"]

_OPTIMIZER_NAMES = ("AdamOptimizer", "LambOptimizer", "SGDOptimizer")

_GROUP_MESSAGE = (
    "Each dict inside 'params' must contain a {'params' : [model parameter names]} entry"
    " and additional entries for custom hyper parameter values"
)


def _check_name(name: Any) -> None:
    _require(isinstance(name, str), "'name' must be a string")
    _require(name in _OPTIMIZER_NAMES, "'name' must be one of 'AdamOptimizer', 'LambOptimizer' or 'SGDOptimizer'")


def _check_defaults(defaults: Any) -> None:
    _require(isinstance(defaults, dict), "'defaults' must be a dict")
    _require("lr" in defaults, "'defaults' must contain a {'lr' : positive number} entry")
    lr = defaults["lr"]
    _require(isinstance(lr, (int, float)) and lr >= 0, "lr must be a positive number")


def _check_groups(params: Any, defaults: dict) -> None:
    _require(isinstance(params, list), "'params' must be a list")
    for group in params:
        _require(isinstance(group, dict) and len(group) > 1 and "params" in group, _GROUP_MESSAGE)
        for key in group:
            # 'lambda_coef' is the constructor's spelling of the 'lambda' default; both are accepted in a group.
            known = key in defaults or key.replace("_coef", "") in defaults
            _require(key == "params" or known, f"'params' has {key} hyper parameter not present at 'defaults'")


def _split_by_type(hyper_parameters: dict[str, Any]) -> tuple[dict[str, float], dict[str, int]]:
    """Split hyper-parameters into the backend's float and int attribute maps.

    Rule (legacy ``ORTTrainer._create_ort_training_session``): ``'params'`` and ``'lr'`` are skipped (the learning
    rate is a graph input, fed per step), ``float`` values are float attributes, ``int`` values (``bool`` and
    ``IntEnum`` included) are int attributes, anything else is a ``ValueError``.
    """
    floats: dict[str, float] = {}
    ints: dict[str, int] = {}
    for key, value in hyper_parameters.items():
        if key in ("params", "lr"):
            continue
        if isinstance(value, float):
            floats[key] = value
        elif isinstance(value, int):
            ints[key] = int(value)
        else:
            raise ValueError("Optimizer attributes must be either float or int.")
    return floats, ints


class _OptimizerConfig:
    r"""Base class for optimizer configurations.

    Args:
        name: one of ``'AdamOptimizer'``, ``'LambOptimizer'``, ``'SGDOptimizer'``.
        params: list of parameter groups. Each group is a dict with a ``'params'`` entry (list of model parameter
            names) and at least one hyper-parameter that overrides ``defaults`` for those parameters. ``[]`` means
            every parameter uses ``defaults``.
        defaults: hyper-parameters for all parameters; must contain ``'lr'`` (a number >= 0).

    After construction ``lr == float(defaults['lr'])``, ``defaults`` is the caller's dict (not a copy) and every
    group in ``params`` holds every hyper-parameter (see :meth:`_add_param_group`).
    """

    def __init__(self, name: str, params: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        _check_name(name)
        _check_defaults(defaults)
        _check_groups(params, defaults)

        self.name = name
        self.lr = float(defaults["lr"])
        self.defaults = defaults
        self.params: list[dict[str, Any]] = []
        for param_group in params:
            self._add_param_group(param_group)

    def _add_param_group(self, param_group: dict[str, Any]) -> None:
        """Complete ``param_group`` in place and append it to :attr:`params`.

        Every default missing from the group is filled in with ``setdefault``; then a ``'lambda_coef'`` key is
        renamed to ``'lambda'`` (the backend's attribute name), replacing the filled-in default. The caller's dict
        is mutated, as in the legacy API, so user code that kept a reference sees the completed group.
        """
        _require(isinstance(param_group, dict), "param group must be a dict")
        for name, value in self.defaults.items():
            param_group.setdefault(name, value)
        if "lambda_coef" in param_group:
            param_group["lambda"] = param_group.pop("lambda_coef")
        self.params.append(param_group)

    def hyper_parameters(self, param_name: str) -> tuple[dict[str, float], dict[str, int]]:
        """Return ``(float_attributes, int_attributes)`` of the optimizer node that updates ``param_name``.

        A parameter listed in groups takes the values of those groups (a later group wins on a shared key); any
        other parameter takes :attr:`defaults`. Values are split by Python type as in :func:`_split_by_type`, so an
        ``int`` given for a float hyper-parameter (``alpha=1``) lands in the int map, exactly as in the legacy API.
        """
        groups = [group for group in self.params if param_name in group["params"]]
        if not groups:
            return _split_by_type(self.defaults)
        floats: dict[str, float] = {}
        ints: dict[str, int] = {}
        for group in groups:
            group_floats, group_ints = _split_by_type(group)
            floats.update(group_floats)
            ints.update(group_ints)
        return floats, ints

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, lr={self.lr!r}, params={self.params!r})"


def _check_common(lr: Any, alpha: Any, beta: Any, lambda_coef: Any) -> None:
    _require(lr >= 0, "'lr' must be a positive number")
    _require(alpha >= 0, "'alpha' must be a positive number")
    _require(beta >= 0, "'beta' must be a positive number")
    _require(lambda_coef >= 0, "'lambda_coef' must be a positive number")


def _check_tail(epsilon: Any, max_norm_clip: Any, do_bias_correction: Any) -> None:
    _require(epsilon >= 0, "'epsilon' must be a positive number")
    _require(max_norm_clip != 0, "'max_norm_clip' must not be 0")
    _require(isinstance(do_bias_correction, bool), "'do_bias_correction' must be a boolean")


def _check_no_group_lr(params: Any) -> None:
    # The learning rate is a single graph input fed per step, so a per-group 'lr' cannot be honoured.
    for param in params:
        _require("lr" not in param, "'lr' is not supported inside params")


class SGDConfig(_OptimizerConfig):
    r"""SGD configuration: ``w <- w - lr * g``.

    Args:
        params: must be ``[]``; SGD supports no parameter groups.
        lr: learning rate (>= 0).
    """

    def __init__(self, params: list[dict[str, Any]] | None = None, lr: float = 0.001) -> None:
        params = [] if params is None else params
        # The base checks run first (and complete the groups), as in the legacy API; only then is SGD's rule applied.
        super().__init__(name="SGDOptimizer", params=params, defaults={"lr": lr})
        _require(isinstance(params, list) and len(params) == 0, "'params' must be an empty list for SGD optimizer")


class AdamConfig(_OptimizerConfig):
    r"""Adam configuration (ONNX Runtime ``AdamOptimizer``).

    Per step ``t`` with gradient ``g``::

        m = alpha * m + (1 - alpha) * g
        v = beta * v + (1 - beta) * g**2
        (bias correction, if do_bias_correction) m_hat = m / (1 - alpha**t), v_hat = v / (1 - beta**t)
        w = w - lr * (m_hat / (sqrt(v_hat) + epsilon) + lambda * w)

    with the weight decay term ``lambda * w`` applied before or after the update per ``weight_decay_mode``.

    Args:
        params: parameter groups (no ``'lr'`` inside a group). A group may spell the decay ``'lambda_coef'``.
        lr, alpha, beta, lambda_coef, epsilon: numbers >= 0.
        max_norm_clip: gradient-norm clip threshold; must not be 0.
        do_bias_correction: bool.
        weight_decay_mode: an :class:`AdamConfig.DecayMode`.

    ``defaults`` stores the decay under the key ``'lambda'``.
    """

    @unique
    class DecayMode(IntEnum):
        """When the weight decay ``lambda * w`` is applied: before or after the Adam update of ``w``."""

        BEFORE_WEIGHT_UPDATE = 0
        AFTER_WEIGHT_UPDATE = 1

    def __init__(
        self,
        params: list[dict[str, Any]] | None = None,
        lr: float = 0.001,
        alpha: float = 0.9,
        beta: float = 0.999,
        lambda_coef: float = 0.0,
        epsilon: float = 1e-8,
        max_norm_clip: float = 1.0,
        do_bias_correction: bool = True,
        weight_decay_mode: AdamConfig.DecayMode = DecayMode.BEFORE_WEIGHT_UPDATE,
    ) -> None:
        params = [] if params is None else params
        _check_common(lr, alpha, beta, lambda_coef)
        _check_tail(epsilon, max_norm_clip, do_bias_correction)
        _require(
            isinstance(weight_decay_mode, AdamConfig.DecayMode), "'weight_decay_mode' must be a AdamConfig.DecayMode"
        )
        _check_no_group_lr(params)

        defaults = {
            "lr": lr,
            "alpha": alpha,
            "beta": beta,
            "lambda": lambda_coef,
            "epsilon": epsilon,
            "max_norm_clip": max_norm_clip,
            "do_bias_correction": do_bias_correction,
            "weight_decay_mode": weight_decay_mode,
        }
        super().__init__(name="AdamOptimizer", params=params, defaults=defaults)
        self.alpha = alpha
        self.beta = beta
        self.lambda_coef = lambda_coef
        self.epsilon = epsilon
        self.max_norm_clip = max_norm_clip
        self.do_bias_correction = do_bias_correction
        self.weight_decay_mode = weight_decay_mode


class LambConfig(_OptimizerConfig):
    r"""LAMB configuration (ONNX Runtime ``LambOptimizer``).

    Per step, with Adam-style moments ``m``, ``v`` (bias-corrected if ``do_bias_correction``)::

        u = m / (sqrt(v) + epsilon) + lambda * w
        ratio = clip(||w|| / ||u||, ratio_min, ratio_max)      (1 when a norm is 0)
        w = w - lr * ratio * u

    Args:
        params: parameter groups (no ``'lr'`` inside a group). A group may spell the decay ``'lambda_coef'``.
        lr, alpha, beta, lambda_coef, epsilon: numbers >= 0.
        ratio_min, ratio_max: ``float`` bounds of the trust ratio (an ``int`` is rejected).
        max_norm_clip: gradient-norm clip threshold; must not be 0.
        do_bias_correction: bool (default False).
    """

    def __init__(
        self,
        params: list[dict[str, Any]] | None = None,
        lr: float = 0.001,
        alpha: float = 0.9,
        beta: float = 0.999,
        lambda_coef: float = 0.0,
        ratio_min: float = float("-inf"),
        ratio_max: float = float("inf"),
        epsilon: float = 1e-6,
        max_norm_clip: float = 1.0,
        do_bias_correction: bool = False,
    ) -> None:
        params = [] if params is None else params
        _check_common(lr, alpha, beta, lambda_coef)
        _require(isinstance(ratio_min, float), "'ratio_min' must be a valid float")
        _require(isinstance(ratio_max, float), "'ratio_max' must be a valid float")
        _check_tail(epsilon, max_norm_clip, do_bias_correction)
        _check_no_group_lr(params)

        defaults = {
            "lr": lr,
            "alpha": alpha,
            "beta": beta,
            "lambda": lambda_coef,
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "epsilon": epsilon,
            "max_norm_clip": max_norm_clip,
            "do_bias_correction": do_bias_correction,
        }
        super().__init__(name="LambOptimizer", params=params, defaults=defaults)
        self.alpha = alpha
        self.beta = beta
        self.lambda_coef = lambda_coef
        self.ratio_min = ratio_min
        self.ratio_max = ratio_max
        self.epsilon = epsilon
        self.max_norm_clip = max_norm_clip
        self.do_bias_correction = do_bias_correction
