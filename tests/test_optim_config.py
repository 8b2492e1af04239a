"""Optimizer configurations: legacy (1.13.1) validation messages, defaults, param-group completion, attribute split."""

from __future__ import annotations

import ast
import enum
import pathlib
import subprocess
import sys
import textwrap

import pytest

from orttrainer import optim
from orttrainer.optim import config as optim_config

PACKAGE_DIR = pathlib.Path(optim_config.__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------------------
# _OptimizerConfig
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,lr,alpha,group_alpha",
    [
        ("AdamOptimizer", 0.1, 0.2, None),
        ("LambOptimizer", 0.2, 0.3, None),
        ("SGDOptimizer", 0.3, 0.4, None),
        ("SGDOptimizer", 0.3, 0.4, 0.5),
    ],
)
def test_base_config_valid(name, lr, alpha, group_alpha):
    defaults = {"lr": lr, "alpha": alpha}
    group = {"params": ["fc1.weight", "fc2.weight"], "alpha": alpha if group_alpha is None else group_alpha}
    cfg = optim_config._OptimizerConfig(name=name, params=[group], defaults=defaults)

    assert cfg.name == name
    assert cfg.lr == lr
    assert cfg.defaults is defaults
    assert cfg.params == [{"params": ["fc1.weight", "fc2.weight"], "alpha": group["alpha"], "lr": lr}]


@pytest.mark.parametrize("lr", [1, 0, 3])
def test_base_config_lr_is_converted_to_float(lr):
    cfg = optim_config._OptimizerConfig("SGDOptimizer", [], {"lr": lr})
    assert cfg.lr == float(lr)
    assert type(cfg.lr) is float


@pytest.mark.parametrize(
    "name,defaults,params,message",
    [
        (optim.AdamConfig, {"lr": 0.003}, [], "'name' must be a string"),
        ("FooOptimizer", {"lr": 0.001}, [], "'name' must be one of 'AdamOptimizer', 'LambOptimizer' or 'SGDOptimizer'"),
        ("SGDOptimizer", [], [], "'defaults' must be a dict"),
        ("SGDOptimizer", {"alpha": 0.1}, [], "'defaults' must contain a {'lr' : positive number} entry"),
        ("AdamOptimizer", {"lr": -1}, [], "lr must be a positive number"),
        ("AdamOptimizer", {"lr": None}, [], "lr must be a positive number"),
        ("AdamOptimizer", {"lr": "0.1"}, [], "lr must be a positive number"),
        ("SGDOptimizer", {"lr": 0.004}, {}, "'params' must be a list"),
        ("AdamOptimizer", {"lr": 0.005, "alpha": 2}, [[]], optim_config._GROUP_MESSAGE),
        ("AdamOptimizer", {"lr": 0.005, "alpha": 2}, [{"alpha": 1}], optim_config._GROUP_MESSAGE),
        ("AdamOptimizer", {"lr": 0.005, "alpha": 2}, [{"params": ["w"]}], optim_config._GROUP_MESSAGE),
        (
            "AdamOptimizer",
            {"lr": 0.005},
            [{"params": "param1", "alpha": 1}],
            "'params' has alpha hyper parameter not present at 'defaults'",
        ),
    ],
)
def test_base_config_invalid(name, defaults, params, message):
    with pytest.raises(AssertionError) as e:
        optim_config._OptimizerConfig(name=name, params=params, defaults=defaults)
    assert str(e.value) == message


def test_group_message_is_verbatim():
    assert optim_config._GROUP_MESSAGE == (
        "Each dict inside 'params' must contain a {'params' : [model parameter names]} entry and additional entries "
        "for custom hyper parameter values"
    )


def test_add_param_group_fills_defaults_in_the_users_dict():
    group = {"params": ["w"], "beta": 0.5}
    cfg = optim.AdamConfig(params=[group], lr=0.01)

    assert cfg.params[0] is group  # legacy mutates the caller's dict instead of copying it
    assert group == {
        "params": ["w"],
        "beta": 0.5,
        "lr": 0.01,
        "alpha": 0.9,
        "lambda": 0.0,
        "epsilon": 1e-8,
        "max_norm_clip": 1.0,
        "do_bias_correction": True,
        "weight_decay_mode": optim.AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE,
    }


@pytest.mark.parametrize("config_class", [optim.AdamConfig, optim.LambConfig])
def test_add_param_group_renames_lambda_coef(config_class):
    group = {"params": ["w"], "lambda_coef": 0.25}
    cfg = config_class(params=[group], lambda_coef=0.5)

    assert "lambda_coef" not in group
    assert group["lambda"] == 0.25  # the group's value wins over the filled-in default
    assert cfg.defaults["lambda"] == 0.5
    assert cfg.lambda_coef == 0.5


def test_groups_without_lambda_get_the_default():
    cfg = optim.LambConfig(params=[{"params": ["a"], "alpha": 0.1}, {"params": ["b"], "lambda": 0.3}], lambda_coef=0.2)
    assert [group["lambda"] for group in cfg.params] == [0.2, 0.3]


def test_add_param_group_rejects_non_dict():
    cfg = optim.SGDConfig()
    with pytest.raises(AssertionError, match="^param group must be a dict$"):
        cfg._add_param_group(["w"])


# ---------------------------------------------------------------------------------------------------------------------
# SGDConfig
# ---------------------------------------------------------------------------------------------------------------------


def test_sgd_defaults():
    cfg = optim.SGDConfig()
    assert cfg.name == "SGDOptimizer"
    assert cfg.lr == 0.001
    assert cfg.defaults == {"lr": 0.001}
    assert cfg.params == []
    assert optim.SGDConfig(lr=0.002).lr == 0.002


def test_sgd_rejects_param_groups():
    with pytest.raises(AssertionError) as e:
        optim.SGDConfig(params=[{"params": ["layer1.weight"], "lr": 0.1}], lr=0.002)
    assert str(e.value) == "'params' must be an empty list for SGD optimizer"


@pytest.mark.parametrize("lr", [-1, -0.5, None, "0.1"])
def test_sgd_rejects_bad_lr(lr):
    with pytest.raises(AssertionError, match="^lr must be a positive number$"):
        optim.SGDConfig(lr=lr)


# ---------------------------------------------------------------------------------------------------------------------
# AdamConfig and LambConfig
# ---------------------------------------------------------------------------------------------------------------------


def test_adam_defaults():
    cfg = optim.AdamConfig()
    assert cfg.name == "AdamOptimizer"
    assert (cfg.lr, cfg.alpha, cfg.beta, cfg.lambda_coef, cfg.epsilon) == (0.001, 0.9, 0.999, 0.0, 1e-8)
    assert cfg.max_norm_clip == 1.0
    assert cfg.do_bias_correction is True
    assert cfg.weight_decay_mode is optim.AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE
    assert cfg.defaults == {
        "lr": 0.001,
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "epsilon": 1e-8,
        "max_norm_clip": 1.0,
        "do_bias_correction": True,
        "weight_decay_mode": optim.AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE,
    }


def test_adam_decay_mode_is_int_enum():
    mode = optim.AdamConfig.DecayMode
    assert issubclass(mode, enum.IntEnum)
    assert [(m.name, int(m)) for m in mode] == [("BEFORE_WEIGHT_UPDATE", 0), ("AFTER_WEIGHT_UPDATE", 1)]
    cfg = optim.AdamConfig(weight_decay_mode=mode.AFTER_WEIGHT_UPDATE)
    assert cfg.defaults["weight_decay_mode"] == 1


def test_lamb_defaults():
    cfg = optim.LambConfig()
    assert cfg.name == "LambOptimizer"
    assert (cfg.lr, cfg.alpha, cfg.beta, cfg.lambda_coef, cfg.epsilon) == (0.001, 0.9, 0.999, 0.0, 1e-6)
    assert (cfg.ratio_min, cfg.ratio_max) == (float("-inf"), float("inf"))
    assert cfg.max_norm_clip == 1.0
    assert cfg.do_bias_correction is False
    assert cfg.defaults == {
        "lr": 0.001,
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "ratio_min": float("-inf"),
        "ratio_max": float("inf"),
        "epsilon": 1e-6,
        "max_norm_clip": 1.0,
        "do_bias_correction": False,
    }


_COMMON_INVALID = [
    ({"lr": -1}, "'lr' must be a positive number"),
    ({"alpha": -0.1}, "'alpha' must be a positive number"),
    ({"beta": -0.1}, "'beta' must be a positive number"),
    ({"lambda_coef": -0.1}, "'lambda_coef' must be a positive number"),
    ({"epsilon": -1e-8}, "'epsilon' must be a positive number"),
    ({"max_norm_clip": 0}, "'max_norm_clip' must not be 0"),
    ({"max_norm_clip": 0.0}, "'max_norm_clip' must not be 0"),
    ({"do_bias_correction": 1}, "'do_bias_correction' must be a boolean"),
    ({"params": [{"params": ["w"], "lr": 0.1}]}, "'lr' is not supported inside params"),
]


@pytest.mark.parametrize(
    "kwargs,message",
    _COMMON_INVALID + [({"weight_decay_mode": 0}, "'weight_decay_mode' must be a AdamConfig.DecayMode")],
)
def test_adam_invalid(kwargs, message):
    with pytest.raises(AssertionError) as e:
        optim.AdamConfig(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "kwargs,message",
    _COMMON_INVALID
    + [
        ({"ratio_min": 0}, "'ratio_min' must be a valid float"),
        ({"ratio_min": None}, "'ratio_min' must be a valid float"),
        ({"ratio_max": 10}, "'ratio_max' must be a valid float"),
    ],
)
def test_lamb_invalid(kwargs, message):
    with pytest.raises(AssertionError) as e:
        optim.LambConfig(**kwargs)
    assert str(e.value) == message


def test_lamb_accepts_float_ratios():
    cfg = optim.LambConfig(ratio_min=0.0, ratio_max=10.0)
    assert (cfg.ratio_min, cfg.ratio_max) == (0.0, 10.0)


def test_negative_max_norm_clip_is_accepted_as_in_legacy():
    assert optim.AdamConfig(max_norm_clip=-1.0).max_norm_clip == -1.0


@pytest.mark.parametrize("config_class", [optim.AdamConfig, optim.LambConfig])
def test_group_overrides_default(config_class):
    cfg = config_class(params=[{"params": ["layer1.weight"], "alpha": 0.1}], alpha=0.2)
    assert len(cfg.params) == 1
    assert cfg.params[0]["alpha"] == 0.1
    assert cfg.defaults["alpha"] == 0.2


def test_default_params_are_not_shared():
    first, second = optim.AdamConfig(), optim.AdamConfig()
    first.params.append({"params": ["w"]})
    assert second.params == []


# ---------------------------------------------------------------------------------------------------------------------
# hyper_parameters: the float/int attribute maps of the backend optimizer nodes
# ---------------------------------------------------------------------------------------------------------------------


def test_adam_attribute_split():
    floats, ints = optim.AdamConfig().hyper_parameters("w")
    assert floats == {"alpha": 0.9, "beta": 0.999, "lambda": 0.0, "epsilon": 1e-8, "max_norm_clip": 1.0}
    assert ints == {"do_bias_correction": 1, "weight_decay_mode": 0}
    assert all(type(v) is int for v in ints.values())


def test_lamb_attribute_split():
    floats, ints = optim.LambConfig().hyper_parameters("w")
    assert floats == {
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "ratio_min": float("-inf"),
        "ratio_max": float("inf"),
        "epsilon": 1e-6,
        "max_norm_clip": 1.0,
    }
    assert ints == {"do_bias_correction": 0}


def test_sgd_has_no_attributes():
    assert optim.SGDConfig(lr=0.5).hyper_parameters("w") == ({}, {})


def test_attribute_split_uses_the_matching_group():
    cfg = optim.LambConfig(
        params=[{"params": ["a", "b"], "alpha": 0.5}, {"params": ["b"], "beta": 0.7, "do_bias_correction": True}]
    )
    assert cfg.hyper_parameters("a")[0]["alpha"] == 0.5
    b_floats, b_ints = cfg.hyper_parameters("b")
    # Both groups list "b"; the later one is applied last, and it carries the filled-in default alpha.
    assert (b_floats["alpha"], b_floats["beta"], b_ints["do_bias_correction"]) == (0.9, 0.7, 1)
    assert cfg.hyper_parameters("c")[0]["alpha"] == 0.9


def test_int_hyper_parameter_lands_in_int_map_as_in_legacy():
    floats, ints = optim.AdamConfig(alpha=1).hyper_parameters("w")
    assert "alpha" not in floats
    assert ints["alpha"] == 1


def test_attribute_of_other_type_is_rejected():
    cfg = optim_config._OptimizerConfig("AdamOptimizer", [], {"lr": 0.1, "alpha": "x"})
    with pytest.raises(ValueError, match="^Optimizer attributes must be either float or int.$"):
        cfg.hyper_parameters("w")


# ---------------------------------------------------------------------------------------------------------------------
# The pure-Python layers import without onnxruntime or torch
# ---------------------------------------------------------------------------------------------------------------------


def test_import_without_onnxruntime():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["onnxruntime"] = None  # any `import onnxruntime` now raises ImportError
        import orttrainer.optim, orttrainer.amp
        import orttrainer.optim.config, orttrainer.optim.lr_scheduler, orttrainer.amp.loss_scaler
        from orttrainer import TrainStepInfo
        info = TrainStepInfo(orttrainer.optim.LambConfig(lr=1.0), optimization_step=5)
        print(orttrainer.optim.LinearWarmupLRScheduler(10, 0.5)._step(info)[0])
        print(orttrainer.amp.DynamicLossScaler().update(info))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE_DIR.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1.0", "65536.0"]


_OWN_MODULES = [
    "optim/__init__.py",
    "optim/config.py",
    "optim/lr_scheduler.py",
    "amp/__init__.py",
    "amp/loss_scaler.py",
    "train_step_info.py",
]


@pytest.mark.parametrize("relative_path", _OWN_MODULES)
def test_module_imports_neither_torch_nor_onnxruntime(relative_path):
    tree = ast.parse((PACKAGE_DIR / relative_path).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & {"torch", "onnxruntime", "numpy", "onnx"}


def test_checks_survive_python_optimize_mode():
    # Validation raises AssertionError explicitly, so `python -O` (which strips `assert`) does not disable it.
    code = textwrap.dedent(
        """
        import orttrainer.optim as optim, orttrainer.amp as amp
        for make in (lambda: optim.AdamConfig(lr=-1), lambda: optim.PolyWarmupLRScheduler(0),
                     lambda: amp.DynamicLossScaler(loss_scale=0)):
            try:
                make()
            except AssertionError as e:
                print(e)
        """
    )
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, cwd=PACKAGE_DIR.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "'lr' must be a positive number",
        "total_steps must be a strict positive number",
        "'loss_scale' must be a positive float",
    ]
