"""OnnxModule's signal ops: DFT, STFT, MelWeightMatrix and the window functions (Hann, Hamming, Blackman), written
from the ONNX operator specification.

Rules: complex values are a trailing dimension of 2 (real, imaginary); a real input has a trailing 1. DFT works
along `axis` (an attribute, default 1, in opset 17; an input, default -2, from 20) with dft_length points (the
input cut or zero-padded); inverse divides by the length; onesided keeps the first length // 2 + 1 frequencies.
STFT frames the signal (frame_step apart, frame_length or the window's length long), weights each frame by the
window (default ones) and takes its DFT. The window functions and MelWeightMatrix depend on their (static)
arguments only.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import Call, Value, axis_of, numpy_dtype, static_op, torch_op


def _complex(t: torch.Tensor) -> torch.Tensor:
    """(..., 1 or 2) real tensor -> complex tensor (...)."""
    if t.shape[-1] == 1:
        return torch.complex(t[..., 0], torch.zeros_like(t[..., 0]))
    return torch.complex(t[..., 0], t[..., 1])


def dft(signal: torch.Tensor, length: int, axis: int, inverse: bool, onesided: bool) -> torch.Tensor:
    """The DFT of `signal` (real (..., 1|2) layout) along `axis`, as a (..., 2) real tensor of its dtype."""
    values = _complex(signal.to(torch.float64))  # numpy's precision: the result is rounded once, at the end
    transformed = torch.fft.ifft(values, n=length, dim=axis) if inverse else torch.fft.fft(values, n=length, dim=axis)
    if onesided:
        transformed = transformed.narrow(axis, 0, transformed.shape[axis] // 2 + 1)
    return torch.view_as_real(transformed).to(signal.dtype)


@torch_op("DFT")
def dft_op(call: Call, x: Value, dft_length: Value | None = None, axis: Value | None = None) -> torch.Tensor:
    t = call.tensor(x)
    if call.opset >= 20:
        dim = axis_of(call.ints(axis, "axis")[0] if axis is not None else -2, t.dim())
    else:
        dim = axis_of(int(call.attr("axis", 1)), t.dim())
    length = call.ints(dft_length, "dft_length")[0] if dft_length is not None else t.shape[dim]
    return dft(t, length, dim, bool(call.attr("inverse", 0)), bool(call.attr("onesided", 0)))


@torch_op("STFT")
def stft(
    call: Call, x: Value, frame_step: Value, window: Value | None = None, frame_length: Value | None = None
) -> torch.Tensor:
    """(batch, frames, bins, 2): frames = 1 + (length - frame_length) // frame_step."""
    t = call.tensor(x)
    step = call.ints(frame_step, "frame_step")[0]
    weights = call.tensor(window) if window is not None else None
    if frame_length is not None:
        size = call.ints(frame_length, "frame_length")[0]
    else:
        size = weights.shape[0] if weights is not None else t.shape[-2]
    if weights is None:
        weights = torch.ones(size, dtype=t.dtype, device=t.device)
    count = 1 + (t.shape[-2] - size) // step
    frames = torch.stack([t.narrow(-2, k * step, size) for k in range(count)], dim=-3)
    weighted = frames * weights.reshape(size, 1).to(t.dtype)
    return dft(weighted, size, weighted.dim() - 2, False, bool(call.attr("onesided", 1)))


def _window_size(call: Call, size: Value) -> tuple[np.ndarray, int]:
    n = call.ints(size, "size")[0]
    periodic = bool(call.attr("periodic", 1))
    return np.arange(n, dtype=np.float64), n if periodic else n - 1


def _window_dtype(call: Call):
    return numpy_dtype(int(call.attr("output_datatype", 1)))


@static_op("HannWindow")
@torch_op("HannWindow")
def hann_window(call: Call, size: Value) -> np.ndarray:
    """sin²(π n / N), N the length (periodic=1, default) or the length - 1."""
    n, denominator = _window_size(call, size)
    return (np.sin(n * np.pi / denominator) ** 2).astype(_window_dtype(call))


@static_op("HammingWindow")
@torch_op("HammingWindow")
def hamming_window(call: Call, size: Value) -> np.ndarray:
    """α - β cos(2π n / N) with α = 25/46, β = 1 - α."""
    n, denominator = _window_size(call, size)
    alpha = 25.0 / 46.0
    return (alpha - np.cos(n * np.pi * 2 / denominator) * (1 - alpha)).astype(_window_dtype(call))


@static_op("BlackmanWindow")
@torch_op("BlackmanWindow")
def blackman_window(call: Call, size: Value) -> np.ndarray:
    """0.42 - 0.5 cos(2π n / N) + 0.08 cos(4π n / N)."""
    n, denominator = _window_size(call, size)
    values = 0.42 - 0.5 * np.cos(n * np.pi * 2 / denominator) + 0.08 * np.cos(n * np.pi * 4 / denominator)
    return values.astype(_window_dtype(call))


@static_op("MelWeightMatrix")
@torch_op("MelWeightMatrix")
def mel_weight_matrix(
    call: Call, mel_bins: Value, dft_length: Value, sample_rate: Value, lower_edge: Value, upper_edge: Value
) -> np.ndarray:
    """(dft_length // 2 + 1, num_mel_bins) triangular filters between lower_edge_hertz and upper_edge_hertz,
    evenly spaced in mel (2595 log10(1 + f / 700)), their corners rounded down to DFT bins."""
    bins = call.ints(mel_bins, "num_mel_bins")[0]
    length = call.ints(dft_length, "dft_length")[0]
    rate = call.numbers(sample_rate, "sample_rate")[0]
    low, high = call.numbers(lower_edge, "lower_edge_hertz")[0], call.numbers(upper_edge, "upper_edge_hertz")[0]
    low_mel, high_mel = 2595 * math.log10(1 + low / 700), 2595 * math.log10(1 + high / 700)
    points = np.arange(bins + 2) * ((high_mel - low_mel) / (bins + 2)) + low_mel
    hertz = 700 * (np.power(10, points / 2595) - 1)
    corners = (((length + 1) * hertz) // rate).astype(int)
    matrix = np.zeros((length // 2 + 1, bins))
    for i in range(bins):
        left, centre, right = corners[i], corners[i + 1], corners[i + 2]
        if centre == left:
            matrix[centre, i] = 1
        else:
            for j in range(left, centre + 1):
                matrix[j, i] = (j - left) / (centre - left)
        for j in range(centre, right):
            matrix[j, i] = (right - j) / (right - centre)
    return matrix.astype(_window_dtype(call))
