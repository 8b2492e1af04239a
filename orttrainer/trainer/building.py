"""How an ORTTrainer gets its session: the model exported (PyTorch, on the first step) or taken as given (ONNX),
post-processed, compiled into the one training graph (`compile.py`), and opened on ONNX Runtime.

`SessionBuilding` is a mixin of `ORTTrainer` that holds only these steps, so `orttrainer.py` reads as the public API;
the state it sets (`_onnx_model`, `_compiled`, `_training_session`, ...) is declared in `ORTTrainer.__init__`.
"""

from __future__ import annotations

import logging

import onnx
import torch

from .._require import require as _require
from . import export as export_mod
from . import state as state_mod
from .builders import TorchSource, choose_builder, ort_only_options
from .compile import CompileRequest, DataParallelPlan, compile_model, output_elem_types, split_parameters
from .distributed import Communicator, partition_parameters
from .graph.data_parallel import DataParallelGraphs
from .graph.editor import tensor_elem_type
from .graph.postprocess import run_postprocess
from .inputs import check_inputs
from .session import SessionConfig, TrainingSession
from .session_dp import DataParallelSession
from .support import gradient_options, onnx_to_torch_dtype, recompute_plan

_logger = logging.getLogger(__name__)


class SessionBuilding:
    """Export, compile and open the session (mixed into `ORTTrainer`)."""

    def _init_onnx_model(self, sample_inputs: list) -> None:
        """Export the PyTorch model (first step), post-process it and create the session."""
        check_inputs(sample_inputs, self.model_desc.inputs)
        internal = self.options._internal_use
        with self._activations.marking():  # counts no debug step; marks subscribed activations
            exported = export_mod.export_model(
                self._torch_model,
                self.loss_fn,
                self.model_desc,
                sample_inputs,
                opset_version=internal.onnx_opset_version,
                enable_contrib_ops=internal.enable_onnx_contrib_ops,
            )
        ort_only = ort_only_options(self.options) + (
            ["orttrainer.debug statistics"] if self._activations.marked else []
        )
        self._builder_choice = choose_builder(
            internal.gradient_builder, custom_functions=exported.custom_functions, ort_only=ort_only
        )
        for i, dtype in enumerate(exported.input_dtypes):
            self.model_desc.add_type_to_input_description(i, dtype)
        for i, dtype in enumerate(exported.output_dtypes):
            self.model_desc.add_type_to_output_description(i, dtype)
        self.torch_sample_outputs = exported.sample_outputs
        self._check_loss_is_scalar(exported)
        self._torch_split = (exported.parameters, exported.buffers)
        self._torch_aliases, self._torch_unused_state = exported.aliases, exported.unused_state
        self._dropout_off = not exported.was_training
        self._torch_source = TorchSource(
            self._torch_model,
            self.loss_fn,
            [d.name for d in self.model_desc.inputs],
            internal.onnx_opset_version,
            exported.was_training,
        )
        forward = self._activations.prepare(exported.model, self.loss_fn, self.model_desc, sample_inputs)
        self._onnx_model = self._postprocess(forward, check_result=False)
        self._sample_inputs = sample_inputs
        try:
            self._init_session()
        finally:
            self._sample_inputs = None  # the torch builder traced them; keep no batch alive

    def _postprocess(self, model: onnx.ModelProto, check_result: bool) -> onnx.ModelProto:
        internal = self.options._internal_use
        if internal.enable_internal_postprocess:
            model = run_postprocess(model)
        if internal.extra_postprocess:
            model = internal.extra_postprocess(model)
            if check_result:
                _require(isinstance(model, onnx.ModelProto), "'extra_postprocess' must return a ONNX model")
        if self.options.utils.run_symbolic_shape_infer:
            from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

            model = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
        return model

    def _init_session(self) -> None:
        losses = [o.name for o in self.model_desc.outputs if o.is_loss]
        _require(len(losses) == 1, f"Only one loss output is supported ({len(losses)} were specified)")
        torch_params, torch_state = getattr(self, "_torch_split", (None, None))
        trainable, frozen = split_parameters(
            self._onnx_model, list(self.options.utils.frozen_weights), torch_params, torch_state
        )
        opts = self.options
        request = CompileRequest(
            forward=self._onnx_model,
            loss_name=losses[0],
            data_inputs=[d.name for d in self.model_desc.inputs],
            outputs=[d.name for d in self.model_desc.outputs],
            trainable=trainable,
            frozen=frozen,
            optim_config=self.optim_config,
            accumulation_steps=opts.batch.gradient_accumulation_steps,
            clip_grad_norm=opts.utils.grad_norm_clip,
            dropout_off=self._dropout_off,
            graph_save_paths=dict(opts.debug.graph_save_paths._validated_opts),
            mixed_precision=opts.mixed_precision.enabled,
            cpu=self._device.type == "cpu",
            data_parallel=self._data_parallel_plan(trainable),
            builder=self._builder_choice,
            torch_source=self._torch_source,
            sample_inputs=self._sample_inputs,
            recompute=recompute_plan(opts),
            gradient_options=gradient_options(opts),
        )
        self._compiled = compile_model(request)
        self._activations.instrument(self._compiled)
        self._frozen = request.frozen  # compile freezes parameters that cannot reach the loss
        self._gradient_builder = self._compiled.builder.builder
        _logger.info("gradient builder '%s' (%s)", self._gradient_builder, self._compiled.builder.reason)
        self._describe_mixed_precision()
        state = self._compiled.initial_state
        config = SessionConfig(
            device=self._device,
            mem_limit=opts.device.mem_limit,
            provider_options=dict(opts._validated_opts["provider_options"]),
            session_options=opts.session_options,
            deterministic=opts.debug.deterministic_compute,
            optimized_model_path=opts.debug.graph_save_paths.model_with_training_graph_after_optimization_path,
        )
        _seed_onnxruntime()
        self._training_session = self._create_session(state, config)
        if self._pending_state is not None:  # load_state_dict before the first step: apply it fully now
            pending, self._pending_state = self._pending_state, None
            state_mod.apply_state_dict(self, *pending)
        from ..checkpoint import _apply_pending_state_dict

        _apply_pending_state_dict(self)  # the same for the experimental_load_state_dict API

    def _data_parallel_plan(self, trainable: list[str]) -> DataParallelPlan | None:
        if self._distributed is None:
            return None
        dist_opts = self.options.distributed
        shapes = {p: tuple(i.dims) for i in self._onnx_model.graph.initializer for p in [i.name] if p in trainable}
        self._zero_owners = (
            partition_parameters(shapes, self._world_size) if dist_opts.deepspeed_zero_optimization.stage > 0 else None
        )
        owned = None if self._zero_owners is None else [p for p in trainable if self._zero_owners[p] == self._rank]
        return DataParallelPlan(self._world_size, dist_opts.allreduce_post_accumulation, dist_opts.enable_adasum, owned)

    def _create_session(self, state: dict, config: SessionConfig) -> TrainingSession:
        compiled = self._compiled
        if compiled.step is None:
            return TrainingSession(compiled.training, compiled.eval_model, state, config, compiled.graph_for)
        return DataParallelSession(
            DataParallelGraphs(compiled.step, compiled.training, compiled.reduced_inputs),
            compiled.eval_model,
            state,
            config,
            Communicator(self._world_size),
            accumulation_steps=self.options.batch.gradient_accumulation_steps,
            adasum=self.options.distributed.enable_adasum,
            owners=self._zero_owners,
            rank=self._rank,
            step_for=compiled.graph_for,
        )

    def _describe_mixed_precision(self) -> None:
        """Record the loss-scale input, the all-finite output and the float16 outputs in model_desc (legacy §3.4)."""
        opts = self.options.mixed_precision
        if not opts.enabled:
            if opts.loss_scaler is not None:
                raise ValueError("Loss Scaler cannot be specified when Mixed Precision is not enabled")
            return
        graph = self._compiled.training
        self.model_desc.loss_scale_input = graph.loss_scale_input
        self.model_desc.all_finite = graph.all_finite_output
        opts.loss_scaler.input_name = graph.loss_scale_input
        types = output_elem_types(self._compiled.eval_model)
        for i, desc in enumerate(self.model_desc.outputs):
            if getattr(desc, "dtype", None) == torch.float32 and types.get(desc.name) == onnx.TensorProto.FLOAT16:
                self.model_desc.add_type_to_output_description(i, desc.dtype, torch.float16)

    def _type_descriptions_from_graph(self) -> None:
        """ONNX model: input and output dtypes come from the graph."""
        graph = self._onnx_model.graph
        known = {v.name for v in list(graph.input) + list(graph.output)}
        for kind, descs, add in (
            ("input", self.model_desc.inputs, self.model_desc.add_type_to_input_description),
            ("output", self.model_desc.outputs, self.model_desc.add_type_to_output_description),
        ):
            for i, desc in enumerate(descs):
                _require(desc.name in known, f"ONNX model with unknown {kind} type ({desc.name})")
                add(i, onnx_to_torch_dtype(tensor_elem_type(self._onnx_model, desc.name)))

    def _check_loss_is_scalar(self, exported) -> None:
        for desc, value in zip(self.model_desc.outputs, exported.sample_outputs, strict=False):
            if desc.is_loss and isinstance(value, torch.Tensor) and value.dim() != 0:
                raise ValueError(
                    f"the loss output {desc.name!r} must be a scalar (shape []), but the model returns "
                    f"shape {list(value.shape)}; reduce it (e.g. mean) in the model or loss_fn"
                )

    def _check_model_export(self, inputs: list) -> None:
        """debug.check_model_export: the exported graph (eval mode) must reproduce PyTorch's outputs."""
        import numpy as np

        outputs = [d.name for d in self.model_desc.outputs]
        results = self._training_session.evaluate(
            dict(zip([d.name for d in self.model_desc.inputs], inputs, strict=True)), outputs
        )
        for name, expected in zip(outputs, self.torch_sample_outputs, strict=False):
            try:
                np.testing.assert_allclose(results[name].cpu().numpy(), expected.cpu().numpy(), rtol=1e-2, atol=1e-6)
            except AssertionError as err:
                raise AssertionError(
                    f"Mismatch between outputs of PyTorch model and exported ONNX model for output {name!r}. Note "
                    "that different backends may exhibit small computational differences. If this is within "
                    "acceptable margin, or if there is random generator in the model causing inevitable mismatch, "
                    f"you can proceed training by setting the flag debug.check_model_export to False.\n{err}"
                ) from err


def _seed_onnxruntime() -> None:
    """Seed ONNX Runtime's RNG (dropout masks) from torch's seed, so `torch.manual_seed` makes runs repeatable.

    Rule: the ONNX Runtime seed is `1 + torch.initial_seed() mod 2**30`. Why: the k-th Dropout computation seeds
    its engine (minstd_rand0) with `seed + k - 1`, and that engine treats a seed ≡ 0 mod 2**31 - 1 as 1, so seed 0
    (`torch.manual_seed(0)`) drew the same mask in the first two steps (verified on 1.19.2)."""
    from onnxruntime.capi import _pybind_state as C

    C.set_seed(1 + torch.initial_seed() % (1 << 30))
