"""OnnxModule's com.microsoft ops: the contrib ops ONNX Runtime's exporters, its transformer optimizer
(`onnxruntime.transformers.optimizer`) and its training graphs put into models, written from ONNX Runtime's
operator documentation (attribute defaults as ONNX Runtime's schemas give them).

- GELU family: Gelu (erf), FastGelu (tanh approximation, optional bias), BiasGelu, QuickGelu (x·sigmoid(αx),
  α 1.702), GemmFastGelu; BiasAdd (X + bias + skip); BiasSoftmax; BiasDropout.
- Normalizations: SkipLayerNormalization (LayerNorm of input + skip (+ bias), epsilon 1e-12; outputs output,
  mean, inv_std_var, input_skip_bias_sum), SkipSimplifiedLayerNormalization and SimplifiedLayerNormalization
  (RMS: x / sqrt(mean(x²) + epsilon)), EmbedLayerNormalization (word + position (+ segment) embeddings,
  LayerNorm; the mask index is the mask's row sums).
- Attention (packed QKV weights; mask_index as end positions [B], end and start positions [2B], or a 0/1 mask
  [B, T] / [B, S, T]; masked scores get mask_filter_value, -10000; optional attention_bias, unidirectional,
  past/present) and MultiHeadAttention (separate query, key, value; key_padding_mask; attention_bias).
- Products: FusedMatMul and its older name TransposeMatMul (alpha · A' @ B'), FusedGemm (Gemm, then an
  activation).
- Training losses: SoftmaxCrossEntropyLossInternal (SoftmaxCrossEntropyLoss with ignore_index as an input),
  SparseSoftmaxCrossEntropy, SoftmaxCrossEntropy (labels as probabilities).
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from .base import MICROSOFT, Call, NodeSpec, Value, axis_of, torch_op
from .linalg import gemm
from .nn import _nll, dropout, layer_norm


def _ms(*op_types: str, check=None):
    return torch_op(*op_types, domain=MICROSOFT, check=check)


@_ms("Gelu")
def gelu(call: Call, x: Value) -> torch.Tensor:
    return F.gelu(call.tensor(x))


@_ms("BiasGelu")
def bias_gelu(call: Call, x: Value, bias: Value) -> torch.Tensor:
    return F.gelu(call.tensor(x) + call.tensor(bias))


@_ms("FastGelu")
def fast_gelu(call: Call, x: Value, bias: Value | None = None) -> torch.Tensor:
    """The tanh approximation of GELU of `x (+ bias)`."""
    value = call.tensor(x) if bias is None else call.tensor(x) + call.tensor(bias)
    return F.gelu(value, approximate="tanh")


@_ms("QuickGelu")
def quick_gelu(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    return t * torch.sigmoid(float(call.attr("alpha", 1.702)) * t)


@_ms("GemmFastGelu")
def gemm_fast_gelu(call: Call, x: Value, w: Value, bias: Value | None = None) -> torch.Tensor:
    product = torch.matmul(*call.tensors(x, w))
    return F.gelu(product if bias is None else product + call.tensor(bias), approximate="tanh")


@_ms("BiasAdd")
def bias_add(call: Call, x: Value, bias: Value, skip: Value) -> torch.Tensor:
    return call.tensor(x) + call.tensor(bias) + call.tensor(skip)


@_ms("BiasSoftmax")
def bias_softmax(call: Call, data: Value, bias: Value) -> torch.Tensor:
    """softmax(data + bias) along `axis` (default 1). The bias lacks k = rank(data) - rank(bias) dimensions and is
    repeated along them: the leading ones (is_inner_broadcast=0), or the k just before `axis` (1)."""
    t, b = call.tensors(data, bias)
    axis = axis_of(int(call.attr("axis", 1)), t.dim())
    missing = t.dim() - b.dim()
    if call.attr("is_inner_broadcast", 0) and missing:
        b = b.reshape(*b.shape[: axis - missing], *([1] * missing), *b.shape[axis - missing :])
    return F.softmax(t + b, dim=axis)


@_ms("BiasDropout")
def bias_dropout(
    call: Call,
    data: Value,
    bias: Value,
    residual: Value | None = None,
    ratio: Value | None = None,
    training_mode: Value | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dropout(data + bias) (+ residual), the mask as a second output (Dropout's rules, nn.py)."""
    summed = call.tensor(data) + call.tensor(bias)
    as_dropout = Call(NodeSpec(call.node.name, "Dropout", "", 13, {}, call.node.outputs), call.device, call.given)
    output, mask = dropout(as_dropout, summed, ratio, training_mode)
    return (output if residual is None else output + call.tensor(residual)), mask


def _rms(t: torch.Tensor, dims: tuple[int, ...], epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = torch.rsqrt((t * t).mean(dim=dims, keepdim=True) + epsilon)
    return t * inv, inv


def _skip_norm(call: Call, values: list[Value | None], simplified: bool) -> list[torch.Tensor]:
    t, skip, gamma = (call.tensor(v) for v in values[:3] if v is not None)
    beta = None if simplified or len(values) < 4 else values[3]
    bias = values[3 if simplified else 4] if len(values) > (3 if simplified else 4) else None
    summed = t + skip + (call.tensor(bias) if bias is not None else 0)
    epsilon = float(call.attr("epsilon", 1e-12))
    computed = summed.float() if summed.dtype in (torch.float16, torch.bfloat16) else summed
    if simplified:
        normalized, inv = _rms(computed, (-1,), epsilon)
        mean = torch.zeros_like(inv)
    else:
        mean = computed.mean(dim=-1, keepdim=True)
        centered = computed - mean
        inv = torch.rsqrt((centered * centered).mean(dim=-1, keepdim=True) + epsilon)
        normalized = centered * inv
    y = normalized.to(t.dtype) * gamma
    if beta is not None:
        y = y + call.tensor(beta)
    return [y, mean, inv, summed]


@_ms("SkipLayerNormalization")
def skip_layer_norm(call: Call, *values: Value | None) -> list[torch.Tensor]:
    return _skip_norm(call, list(values), simplified=False)


@_ms("SkipSimplifiedLayerNormalization")
def skip_simplified_layer_norm(call: Call, *values: Value | None) -> list[torch.Tensor]:
    return _skip_norm(call, list(values), simplified=True)


@torch_op("SimplifiedLayerNormalization")
@_ms("SimplifiedLayerNormalization")
def simplified_layer_norm(call: Call, x: Value, scale: Value) -> list[torch.Tensor]:
    """RMS normalization over the dimensions from `axis` (default -1), epsilon 1e-5: outputs Y, inv_std_var."""
    t = call.tensor(x)
    axis = axis_of(int(call.attr("axis", -1)), t.dim())
    computed = t.float() if int(call.attr("stash_type", 1)) == 1 and t.dtype in (torch.float16, torch.bfloat16) else t
    normalized, inv = _rms(computed, tuple(range(axis, t.dim())), float(call.attr("epsilon", 1e-5)))
    return [normalized.to(t.dtype) * call.tensor(scale), inv]


torch_op("LayerNormalization", domain=MICROSOFT)(layer_norm)


@_ms("EmbedLayerNormalization")
def embed_layer_norm(
    call: Call,
    input_ids: Value,
    segment_ids: Value | None,
    word_embedding: Value,
    position_embedding: Value,
    segment_embedding: Value | None,
    gamma: Value,
    beta: Value,
    mask: Value | None = None,
    position_ids: Value | None = None,
) -> list[torch.Tensor | None]:
    """LayerNorm(word[ids] + position[position_ids, default 0..S-1] (+ segment[segment_ids])) * gamma + beta;
    mask_index = the mask's row sums (int32; zeros without a mask); embedding_sum = the sum before LayerNorm."""
    ids = call.tensor(input_ids).to(torch.int64)
    words = call.tensor(word_embedding)[ids]
    if position_ids is not None:
        positions = call.tensor(position_ids).to(torch.int64).expand(ids.shape)
    else:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
    summed = words + call.tensor(position_embedding)[positions]
    if segment_ids is not None and segment_embedding is not None:
        summed = summed + call.tensor(segment_embedding)[call.tensor(segment_ids).to(torch.int64)]
    mean = summed.mean(dim=-1, keepdim=True)
    centered = summed - mean
    inv = torch.rsqrt((centered * centered).mean(dim=-1, keepdim=True) + float(call.attr("epsilon", 1e-12)))
    y = centered * inv * call.tensor(gamma) + call.tensor(beta)
    if mask is not None:
        index = call.tensor(mask).to(torch.int64).sum(dim=1).to(torch.int32)
    else:
        index = torch.zeros(ids.shape[0], dtype=torch.int32, device=ids.device)
    return [y, index, summed]


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, N·h) -> (B, N, S, h)."""
    b, s, d = t.shape
    return t.reshape(b, s, heads, d // heads).transpose(1, 2)


def _key_mask(call: Call, mask: Value, batch: int, queries: int, keys: int, past: int) -> torch.Tensor:
    """A mask_index / key_padding_mask as a boolean (B, 1, S, T) tensor, true where the key is masked."""
    m = call.tensor(mask)
    positions = torch.arange(keys, device=m.device)
    if m.dim() == 1 and m.shape[0] == 2 * batch:  # end positions, then start positions
        end, start = m[:batch].to(torch.int64), m[batch:].to(torch.int64)
        masked = (positions >= end[:, None]) | (positions < start[:, None])
        return masked[:, None, None, :]
    if m.dim() == 1:  # end positions
        return (positions >= m.to(torch.int64)[:, None])[:, None, None, :]
    if m.dim() == 2:  # (B, T) 1 keep / 0 mask
        return (m == 0)[:, None, None, :]
    if m.dim() == 3:  # (B, S, T)
        return (m == 0)[:, None, :, :]
    raise call.fail(f"a mask of shape {tuple(m.shape)} is not supported (1-D, 2-D or 3-D masks are)")


def _attend(
    call: Call,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Value | None,
    attention_bias: Value | None,
    past: int,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + masks + bias) v for (B, N, S, h) q and (B, N, T, h) k, v; -> (B, S, N·hv)."""
    batch, heads, queries, size = q.shape
    keys = k.shape[2]
    scale = float(call.attr("scale", 1.0 / math.sqrt(size)))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    filler = float(call.attr("mask_filter_value", -10000.0))
    if mask is not None:
        masked = _key_mask(call, mask, batch, queries, keys, past)
        scores = scores + masked.to(scores.dtype) * filler
    if call.attr("unidirectional", 0):  # later keys are excluded outright (the lowest value, not the filler)
        later = torch.arange(keys, device=q.device)[None, :] > torch.arange(queries, device=q.device)[:, None] + past
        scores = scores.masked_fill(later, torch.finfo(scores.dtype).min)
    if attention_bias is not None:
        scores = scores + call.tensor(attention_bias)
    out = torch.matmul(F.softmax(scores, dim=-1), v)
    return out.transpose(1, 2).reshape(batch, queries, -1)


@_ms("Attention", check=lambda n: "do_rotary is not supported" if n.attr("do_rotary", 0) else None)
def attention(
    call: Call,
    x: Value,
    weights: Value,
    bias: Value | None = None,
    mask_index: Value | None = None,
    past: Value | None = None,
    attention_bias: Value | None = None,
    past_sequence_length: Value | None = None,
) -> list[torch.Tensor | None]:
    """Multi-head self-attention with packed QKV weights (qkv_hidden_sizes, default three equal parts); outputs
    output and present = (2, B, N, past + S, h) when asked for."""
    t, w = call.tensors(x, weights)
    heads = int(call.attr("num_heads"))
    sizes = list(call.attr("qkv_hidden_sizes", [w.shape[1] // 3] * 3))
    projected = torch.matmul(t, w) + (call.tensor(bias) if bias is not None else 0)
    q, k, v = (_heads(p, heads) for p in projected.split(sizes, dim=-1))
    past_length = 0
    if past is not None:
        previous = call.tensor(past)
        past_length = previous.shape[3]
        k, v = torch.cat([previous[0], k], dim=2), torch.cat([previous[1], v], dim=2)
    output = _attend(call, q, k, v, mask_index, attention_bias, past_length)
    return [output, torch.stack([k, v]) if call.wants(1) else None]


@_ms("MultiHeadAttention")
def multi_head_attention(
    call: Call,
    query: Value,
    key: Value | None = None,
    value: Value | None = None,
    bias: Value | None = None,
    key_padding_mask: Value | None = None,
    attention_bias: Value | None = None,
    past_key: Value | None = None,
    past_value: Value | None = None,
) -> list[torch.Tensor | None]:
    """Attention of query (B, S, D) over key (B, L, D) and value (B, L, Dv) (self-attention when they are
    missing), each with its part of `bias`; past_key/past_value (B, N, P, h) are prepended; outputs output,
    present_key, present_value."""
    q = call.tensor(query)
    k = call.tensor(key) if key is not None else q
    v = call.tensor(value) if value is not None else k
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise call.fail("only unpacked (B, S, D) query, key and value are supported")
    heads = int(call.attr("num_heads"))
    if bias is not None:
        bq, bk, bv = call.tensor(bias).split([q.shape[-1], k.shape[-1], v.shape[-1]])
        q, k, v = q + bq, k + bk, v + bv
    qh, kh, vh = _heads(q, heads), _heads(k, heads), _heads(v, heads)
    past_length = 0
    if past_key is not None and past_value is not None:
        pk, pv = call.tensors(past_key, past_value)
        past_length = pk.shape[2]
        kh, vh = torch.cat([pk, kh], dim=2), torch.cat([pv, vh], dim=2)
    output = _attend(call, qh, kh, vh, key_padding_mask, attention_bias, past_length)
    return [output, kh if call.wants(1) else None, vh if call.wants(2) else None]


def _fused_check(node: NodeSpec) -> str | None:
    if node.attr("transBatchA", 0) or node.attr("transBatchB", 0):
        return "transBatchA/transBatchB are not supported"
    return None


@_ms("FusedMatMul", "TransposeMatMul", check=_fused_check)
def fused_matmul(call: Call, a: Value, b: Value) -> torch.Tensor:
    """alpha · A' @ B', A' = A with its last two dimensions swapped when transA (B' likewise)."""
    x, y = call.tensors(a, b)
    x = x.transpose(-1, -2) if call.attr("transA", 0) and x.dim() > 1 else x
    y = y.transpose(-1, -2) if call.attr("transB", 0) and y.dim() > 1 else y
    alpha = float(call.attr("alpha", 1.0))
    product = torch.matmul(x, y)
    return product if alpha == 1.0 else alpha * product


_FUSED_ACTIVATIONS = {
    "Relu": lambda t, a, b: torch.relu(t),
    "Tanh": lambda t, a, b: torch.tanh(t),
    "Sigmoid": lambda t, a, b: torch.sigmoid(t),
    "LeakyRelu": lambda t, a, b: F.leaky_relu(t, a if a is not None else 0.01),
    "HardSigmoid": lambda t, a, b: torch.clamp(
        (a if a is not None else 0.2) * t + (b if b is not None else 0.5), 0.0, 1.0
    ),
}


def _fused_gemm_check(node: NodeSpec) -> str | None:
    activation = node.attr("activation")
    return None if activation is None or activation in _FUSED_ACTIVATIONS else f"activation {activation!r}"


@_ms("FusedGemm", check=_fused_gemm_check)
def fused_gemm(call: Call, a: Value, b: Value, c: Value | None = None) -> torch.Tensor:
    y = gemm(call, a, b, c)
    activation = call.attr("activation")
    if activation is None:
        return y
    return _FUSED_ACTIVATIONS[activation](y, call.attr("activation_alpha"), call.attr("activation_beta"))


@_ms("SoftmaxCrossEntropyLossInternal")
def softmax_cross_entropy_loss_internal(
    call: Call, scores: Value, labels: Value, weights: Value | None = None, ignore_index: Value | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """SoftmaxCrossEntropyLoss (reduction 'mean' by default) with ignore_index read from its input."""
    attrs = dict(call.node.attrs)
    if ignore_index is not None:
        attrs["ignore_index"] = call.ints(ignore_index, "ignore_index")[0]
    inner = Call(NodeSpec(call.node.name, "SoftmaxCrossEntropyLoss", "", 13, attrs, call.node.outputs), call.device)
    log_prob = F.log_softmax(call.tensor(scores), dim=1)
    return _nll(inner, log_prob, labels, weights), log_prob


@_ms("SparseSoftmaxCrossEntropy")
def sparse_softmax_cross_entropy(
    call: Call, logits: Value, label: Value, weight: Value | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-log_softmax(logits)[label] over the last dimension, times the per-element weight, reduced by `reduction`
    ('mean': divided by the number of elements, or by the summed weights; 'sum'; 'none')."""
    log_prob = F.log_softmax(call.tensor(logits), dim=-1)
    index = call.tensor(label).to(torch.int64)
    losses = -torch.gather(log_prob, -1, index.unsqueeze(-1)).squeeze(-1)
    reduction = str(call.attr("reduction", "mean"))
    if weight is not None:
        w = call.tensor(weight).to(losses.dtype)
        losses = losses * w
        if reduction == "mean":
            return losses.sum() / w.sum(), log_prob
    if reduction == "none":
        return losses, log_prob
    return (losses.mean() if reduction == "mean" else losses.sum()), log_prob


@_ms("SoftmaxCrossEntropy")
def softmax_cross_entropy(call: Call, logits: Value, label: Value) -> tuple[torch.Tensor, torch.Tensor]:
    """-sum(label · log_softmax(logits)) over the last dimension, summed ('sum') or averaged over the other
    dimensions ('mean', default)."""
    log_prob = F.log_softmax(call.tensor(logits), dim=-1)
    losses = -(call.tensor(label) * log_prob).sum(dim=-1)
    return (losses.sum() if call.attr("reduction", "mean") == "sum" else losses.mean()), log_prob
