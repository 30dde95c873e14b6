"""Decompositions neuronc writes itself: ATen ops that neither torch-mlir nor torch's own
decomposition table lowers, rewritten into ops that reach StableHLO. One function per op, in a
registry (`OWN`); `torch_import.decomposition_table` merges it after torch-mlir's and torch's tables.
Each is checked against eager in tests/test_ops.py or tests/test_op_coverage.py.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import torch

aten = torch.ops.aten

EMBEDDING_BAG_MODES = {0: "sum", 1: "mean", 2: "max"}


def _stable_sort(x, *, stable=None, dim=-1, descending=False):
    """torch-mlir lowers only sort.default; neuronc's sort keeps equal keys in order either way (stable)."""
    return aten.sort.default(x, dim, descending)


def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """Bags of rows of `weight`: bag b holds indices[offsets[b]:offsets[b + 1]]. With static shapes, the bag
    of each index is a count of the offsets at or before it; sum and mean add rows into their bag
    (index_add: a scatter-add), max takes a masked maximum over every (bag, index) pair."""
    count = indices.shape[0]
    starts = offsets[:-1] if include_last_offset else offsets
    bags = starts.shape[0]
    position = torch.arange(count, device=indices.device)
    bag_of = (position[:, None] >= starts[None, :]).sum(1) - 1  # offset2bag
    if include_last_offset:
        bag_of = torch.where(position < offsets[-1], bag_of, bags)  # indices past the last offset join no bag
    keep = (indices != padding_idx) & (bag_of < bags) if padding_idx >= 0 else bag_of < bags
    rows = weight[indices]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    rows = torch.where(keep[:, None], rows, torch.zeros((), dtype=rows.dtype))
    safe_bag = torch.where(keep, bag_of, 0)
    sizes = torch.zeros(bags, dtype=torch.int64, device=weight.device).index_add(0, safe_bag, keep.long())
    mode_name = EMBEDDING_BAG_MODES[mode]
    if mode_name == "max":
        member = (bag_of[None, :] == torch.arange(bags, device=weight.device)[:, None]) & keep[None, :]  # [bags, count]
        lowest = torch.finfo(rows.dtype).min
        candidates = torch.where(member[:, :, None], rows[None, :, :], lowest)
        output, arg = candidates.max(dim=1)
        output = torch.where(sizes[:, None] > 0, output, torch.zeros((), dtype=rows.dtype))
        max_indices = torch.where(sizes[:, None] > 0, indices[arg], -1)
    else:
        output = torch.zeros(bags, weight.shape[1], dtype=rows.dtype, device=weight.device).index_add(0, safe_bag, rows)
        if mode_name == "mean":
            output = output / sizes.clamp(min=1)[:, None].to(rows.dtype)
        max_indices = torch.zeros(bags if mode_name == "max" else 0, dtype=torch.int64, device=weight.device)
    return output, bag_of, sizes, max_indices


def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                            scale_grad_by_freq, mode, sparse, per_sample_weights=None, padding_idx=-1):
    """The weight's (dense) gradient of `_embedding_bag`: each kept index's row gets its bag's gradient, times its
    per-sample weight, over the bag's size for mean, over how often the index occurs with scale_grad_by_freq;
    for max, each (bag, column)'s gradient goes to the row that was the maximum there (none for an empty bag)."""
    if sparse or scale_grad_by_freq:  # a sparse gradient is no device tensor; with scale_grad_by_freq, ATen's CPU
        return NotImplemented  # kernel divides some rows by another index's count: the CPU fallback gives eager's
    bags, width = grad.shape
    gradient = torch.zeros(num_weights, width, dtype=grad.dtype, device=grad.device)
    if EMBEDDING_BAG_MODES[mode] == "max":
        found = maximum_indices >= 0
        return gradient.scatter_add(0, torch.where(found, maximum_indices, 0), torch.where(found, grad, 0.0))
    offset2bag = _offset2bag(offset2bag, indices, offsets, bags)
    keep = offset2bag < bags
    if padding_idx >= 0:
        keep = keep & (indices != padding_idx)
    bag = torch.where(keep, offset2bag, 0)
    rows = grad[bag]
    if EMBEDDING_BAG_MODES[mode] == "mean":
        rows = rows / bag_size[bag].clamp(min=1)[:, None].to(grad.dtype)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    rows = torch.where(keep[:, None], rows, 0.0)
    return gradient.index_add(0, torch.where(keep, indices, 0), rows)


def _offset2bag(offset2bag, indices, offsets, bags: int):
    """Each index's bag: the forward's, or (ATen's forward leaves it empty in sum mode) counted from the offsets."""
    if offset2bag.numel() == indices.numel():
        return offset2bag
    position = torch.arange(indices.shape[0], device=indices.device)
    return (position[:, None] >= offsets[None, :bags]).sum(1) - 1


def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    """Each per-sample weight's gradient (sum mode only, as ATen): its bag's gradient dotted with its row, zero for
    the padding index."""
    bag = _offset2bag(offset2bag, indices, offsets, grad.shape[0])
    keep = bag < grad.shape[0]  # indices past include_last_offset's last offset are in no bag
    if padding_idx >= 0:
        keep = keep & (indices != padding_idx)
    dots = (grad[torch.where(keep, bag, 0)] * weight[indices]).sum(-1)
    return torch.where(keep, dots, 0.0)


def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq,
                                  mode, per_sample_weights=None, padding_idx=-1):
    if offset2bag.numel() != indices.numel():  # no offsets to count the bags from
        return NotImplemented
    return _embedding_bag_backward(grad, indices, None, offset2bag, bag_size, maximum_indices, num_weights,
                                   scale_grad_by_freq, mode, False, per_sample_weights, padding_idx)


def _convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                          output_mask):
    """The gradients of a convolution, as convolutions. torch-mlir lowers `convolution_backward` only for a plain
    2-D convolution without groups or dilation, and not when an output padding is needed (an odd size with a
    stride), so every form is decomposed here. A plain convolution's input gradient is the transposed convolution
    of the output's gradient (`_windowed_transposed_convolution`); a transposed convolution is the adjoint of the
    plain one by the same weight, so its input gradient is that plain convolution of the output's gradient.
    Weight gradients: `_convolution_weight_gradient`."""
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = aten.convolution.default(grad, weight, None, stride, padding, dilation, False,
                                                  [0] * len(stride), groups)
            grad_input = grad_input[(..., *(slice(0, i) for i in x.shape[2:]))]
        else:
            grad_input = _windowed_transposed_convolution(grad, weight, stride, padding, dilation, groups, x.shape[2:])
    if output_mask[1]:
        grad_weight = (_convolution_weight_gradient(grad, x, weight.shape, stride, padding, dilation, groups)
                       if transposed else
                       _convolution_weight_gradient(x, grad, weight.shape, stride, padding, dilation, groups))
    if output_mask[2]:
        grad_bias = grad.sum([0, *range(2, grad.dim())])
    return grad_input, grad_weight, grad_bias


def _transposed_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A transposed convolution whose output padding reaches past its stride (allowed below its dilation), which
    torch-mlir does not lower: windowed from its uncropped form, the bias added after."""
    if not transposed or not any(output_padding) or (all(d == 1 for d in dilation)
                                                     and all(o < s for o, s in zip(output_padding, stride))):
        return NotImplemented
    sizes = [(i - 1) * s - 2 * p + d * (k - 1) + o + 1
             for i, s, p, d, k, o in zip(x.shape[2:], stride, padding, dilation, weight.shape[2:], output_padding)]
    output = _windowed_transposed_convolution(x, weight, stride, padding, dilation, groups, sizes)
    return output if bias is None else output + bias.view(-1, *[1] * len(stride))


def _windowed_transposed_convolution(x, weight, stride, padding, dilation, groups, sizes):
    """The transposed convolution of ``x`` whose output has the spatial ``sizes``: taken uncropped (every tap's
    position, no padding and no output padding, which torch-mlir does not lower with dilation), then its window
    from ``padding`` on, zeros where no tap reached."""
    spatial = len(stride)
    full = aten.convolution.default(x, weight, None, stride, [0] * spatial, dilation, True, [0] * spatial, groups)
    missing = [max(0, p + n - f) for p, n, f in zip(padding, sizes, full.shape[2:])]
    if any(missing):
        full = aten.constant_pad_nd.default(full, [n for m in reversed(missing) for n in (0, m)])
    return full[(..., *(slice(p, p + n) for p, n in zip(padding, sizes)))]


def _convolution_weight_gradient(x, grad, weight_shape, stride, padding, dilation, groups):
    """d(loss)/d(weight) of the plain convolution of ``x`` ([N, groups * Ci, *I]) giving ``grad``'s shape
    ([N, groups * Co, *O]), weight [groups * Co, Ci, *K]: w[(g, co), ci, k] = sum over n and o of
    grad[n, (g, co), o] * x[n, (g, ci), o * stride - padding + k * dilation]. One grouped convolution: the batch
    becomes the channels (grouped by g) and each ci a batch entry, the output's gradient the kernel, the stride
    the dilation and the dilation the stride; the result is cropped to K."""
    n, spatial = x.shape[0], x.shape[2:]
    ci = x.shape[1] // groups
    inputs = x.reshape(n, groups, ci, *spatial).permute(2, 1, 0, *range(3, 3 + len(spatial)))
    inputs = inputs.reshape(ci, groups * n, *spatial)  # [ci, (g, n), *I]
    kernel = grad.transpose(0, 1)  # [(g, co), n, *O]
    out = aten.convolution.default(inputs, kernel, None, dilation, padding, stride, False, [0] * len(spatial), groups)
    out = out[(..., *(slice(0, k) for k in weight_shape[2:]))]  # [ci, (g, co), *K]
    return out.transpose(0, 1).contiguous()


def merge_into(table: dict, own: dict) -> None:
    """`own`'s decompositions into `table`. One marked `for_some_inputs` (it returns NotImplemented for the inputs
    it is not for: an fp32 GELU for the 16-bit one) keeps the entry it replaces for those inputs; any other
    replaces it (its NotImplemented keeps the op)."""
    for op, fn in own.items():
        previous = table.get(op)
        table[op] = _first_of(fn, previous) if previous is not None and getattr(fn, "for_some_inputs", False) else fn


def _first_of(fn, previous):
    def decomposed(*args, **kwargs):
        result = fn(*args, **kwargs)
        return previous(*args, **kwargs) if result is NotImplemented else result
    return decomposed


def _for_some_inputs(fn):
    fn.for_some_inputs = True
    return fn


def _python_remainder(a, b):
    """torch.remainder is Python's modulo (the divisor's sign); torch-mlir lowers it to stablehlo.remainder,
    C's fmod (the dividend's sign), and torch's own decomposition gives prims.remainder, which torch-mlir
    does not lower. fmod, moved into the divisor's sign."""
    divisor_negative = b < 0
    if not isinstance(b, torch.Tensor):  # torch-mlir lowers fmod.Tensor, not fmod.Scalar
        b = torch.scalar_tensor(b, dtype=a.dtype)
    r = torch.fmod(a, b)
    return torch.where((r != 0) & ((r < 0) != divisor_negative), r + b, r)


@_for_some_inputs
def _floor_divide(a, b):
    """PyTorch's floor division (c10's div_floor_integer / div_floor_floating). torch-mlir lowers it as
    floor(a / b): integers through float64, which the device computes in fp32 (2**31 - 1 // 2 gave 2**30), and
    floats without ATen's correction (1.0 // 0.1 is 9.0 in eager, inf // 2 NaN). Integers: the truncating
    quotient less one where the remainder is nonzero and the signs differ; floats: ATen's formula, in the operands'
    dtype (eager's vectorized kernel rounds each step of a bf16 or fp16 one to it), but a bf16 or fp16 tensor over
    a number in fp32 with the number as given, rounded once (as eager computes it)."""
    dtype = torch.result_type(a, b)
    if dtype in _REDUCED_FLOATS and not isinstance(b, torch.Tensor):  # over a number: in fp32, the number as given
        return _floor_divide(a.float(), b).to(dtype)
    a = a.to(dtype) if isinstance(a, torch.Tensor) else torch.scalar_tensor(a, dtype=dtype)
    b = b.to(dtype) if isinstance(b, torch.Tensor) else torch.scalar_tensor(b, dtype=dtype, device=a.device)
    if dtype == torch.bool:
        return NotImplemented  # eager refuses it
    if not dtype.is_floating_point:
        quotient = aten.div.Tensor_mode(a, b, rounding_mode="trunc")
        remainder = torch.fmod(a, b)
        return torch.where((remainder != 0) & ((remainder < 0) != (b < 0)), quotient - 1, quotient)
    mod = torch.fmod(a, b)
    div = (a - mod) / b
    div = torch.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floored = torch.floor(div)
    floored = torch.where(div - floored > 0.5, floored + 1, floored)
    quotient = a / b
    result = torch.where(div != 0, floored, quotient * 0)  # a zero: copysign(0, a / b), a / b finite there
    return torch.where(b == 0, quotient, result)


@_for_some_inputs
def _div_rounded(a, b, rounding_mode=None):
    """torch.div with rounding_mode="floor" is floor division (above); "trunc" of floats is trunc(a / b), the
    quotient rounded to the operands' dtype first as eager's vectorized kernel rounds it (over a number: in fp32,
    as for floor division), with a zero's sign kept
    (torch-mlir's trunc is sign(x) * floor(|x|): 0 / -2 gave +0.0); the rest as torch-mlir lowers them."""
    if rounding_mode == "floor":
        return _floor_divide(a, b)
    dtype = torch.result_type(a, b)
    if rounding_mode != "trunc" or not dtype.is_floating_point:
        return NotImplemented
    if dtype in _REDUCED_FLOATS and not isinstance(b, torch.Tensor):  # over a number: in fp32, the number as given
        return _div_rounded(a.float(), b, rounding_mode).to(dtype)
    quotient = aten.div.Tensor(a, b) if isinstance(b, torch.Tensor) else aten.div.Scalar(a, b)
    return torch.where(quotient < 0, torch.ceil(quotient), torch.floor(quotient))


@_for_some_inputs
def _bf16_power(x, exponent):
    """bf16 x ** 3 and x ** -2 as eager's vectorized kernel computes them: x * x * x and 1 / (x * x), each step rounded
    to bf16 (torch-mlir's power rounded once: a fifth to a quarter of the elements differed). Other exponents and
    dtypes (fp16's is fp32 rounded once) as torch-mlir lowers them."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or type(exponent) not in (int, float):
        return NotImplemented
    if exponent == 3:
        return x * x * x
    if exponent == -2:
        return torch.reciprocal(x * x)
    return NotImplemented


_REDUCED_FLOATS = (torch.bfloat16, torch.float16)


def _scalar_kept_in_fp32(op):
    """``x * number`` and ``x / number`` of a bf16 or fp16 tensor as eager's CPU kernels compute them: the number
    kept in fp32 (TensorIterator's original_scalar_value), x widened, the result rounded once (its add and sub round
    the number to x's dtype, as torch-mlir does). torch-mlir rounds the number first: bf16 x * 0.1 differed from
    eager in a fifth of the elements, x / 0.3 in half, fp16 x * 1e5 was inf * x (NaN at zero)."""
    def decomposed(a, b):
        if not (isinstance(a, torch.Tensor) and a.dtype in _REDUCED_FLOATS and type(b) in (int, float)):
            return NotImplemented
        return op(a.float(), b).to(a.dtype)
    return _for_some_inputs(decomposed)


def _computed_in_fp32(op):
    """``op`` of bf16 or fp16 tensors as eager's CPU kernels compute it: in fp32, rounded once. torch-mlir lowers
    these ops to several StableHLO ops in the tensors' dtype, each rounded: a bf16 GELU differed from eager in 44%
    of its elements, logaddexp in 15%, elu and leaky_relu in 9-18%, log_softmax in 7%."""
    def decomposed(x, *args, **kwargs):
        if not (isinstance(x, torch.Tensor) and x.dtype in _REDUCED_FLOATS):
            return NotImplemented
        widened = [a.float() if isinstance(a, torch.Tensor) and a.dtype == x.dtype else a for a in args]
        return op(x.float(), *widened, **kwargs).to(x.dtype)
    return _for_some_inputs(decomposed)


@_for_some_inputs
def _log_softmax(x, dim, half_to_float):
    """A bf16 or fp16 log_softmax over the last dim as eager's vectorized kernel computes it: in fp32, but the sum
    of exponentials and its log each rounded to the input's dtype (it keeps them in the input's type) before
    x - max - log(sum) is rounded once. Other dims and dtypes: as torch-mlir lowers it."""
    if x.dtype not in _REDUCED_FLOATS or half_to_float or dim % max(1, x.dim()) != max(0, x.dim() - 1):
        return NotImplemented
    wide = x.float()
    shifted = wide - torch.amax(wide, dim, keepdim=True)
    total = torch.exp(shifted).sum(dim, keepdim=True).to(x.dtype).float()
    return (shifted - torch.log(total).to(x.dtype).float()).to(x.dtype)


# Ops eager computes in one fp32 kernel from 16-bit inputs, rounding once, which torch-mlir lowers to several steps
# each rounded to the 16-bit dtype (each differed from eager in 7-47% of a bf16 tensor's elements; docs op
# coverage part 16 lists the sweep).
_ONE_KERNEL_IN_FP32 = (
    aten.gelu.default, aten.elu.default, aten.leaky_relu.default, aten.logaddexp.default, aten.logaddexp2.default,
    aten.log10.default, aten.log2.default, aten.asin.default, aten.acos.default, aten.asinh.default,
    aten.acosh.default, aten.atanh.default,
)


def _fmod_by_scalar(a, b):
    """torch-mlir lowers fmod.Tensor but not fmod.Scalar (grid_sample's reflection padding uses it): the scalar
    as a 0-d tensor of the promoted dtype (an int tensor modulo 2.5 is float, as in eager)."""
    dtype = torch.result_type(a, b)
    return aten.fmod.Tensor(a.to(dtype), torch.scalar_tensor(b, dtype=dtype, device=a.device))


def _tuple(value, n: int) -> tuple:
    value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return value * n if len(value) == 1 else value


def _pair(value) -> tuple:
    return _tuple(value, 2)


def _pooled_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """PyTorch's pooling_output_shape: with ceil_mode, a last partial window counts if it starts inside the
    input or its left padding."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _pool_geometry(x, nd, kernel_size, stride, padding, dilation, ceil_mode):
    """Per spatial dim (kernel, stride, padding, dilation, output size, extra high padding): the padding
    a ceil_mode window reaches past the input's right padding is explicit, so no window is cut short."""
    kernel = _tuple(kernel_size, nd)
    stride = _tuple(stride or kernel_size, nd)
    padding, dilation = _tuple(padding, nd), _tuple(dilation, nd)
    dims = []
    for size, k, s, p, d in zip(x.shape[-nd:], kernel, stride, padding, dilation):
        out = _pooled_size(size, k, s, p, d, ceil_mode)
        extra = max(0, (out - 1) * s + d * (k - 1) + 1 - (size + 2 * p))
        dims.append((k, s, p, d, out, extra))
    return dims


def _pad_spatial(x, dims, value):
    pads = []
    for k, s, p, d, out, extra in reversed(dims):  # constant_pad_nd lists the last dim first
        pads += [p, p + extra]
    return aten.constant_pad_nd(x, pads, value)


def _max_pool_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False, *, nd):
    """Max pooling (2-d, 3-d) as the running maximum of the window's strided views of the (-inf padded)
    input, and the flat input index of the maximum eager picks (the first; the last NaN, as eager's
    `val > max || isnan(val)`). ceil_mode's last partial window reads -inf past the input. Strided views and
    elementwise maxima fuse into one kernel, where torch's own decomposition gathers every window element;
    the indices, needed only for the backward, are dead code in inference. (torch-mlir's own lowering of
    max_pool3d with ceil_mode pads both sides, which shifts every window: wrong results.)"""
    if x.dim() not in (nd + 1, nd + 2) or not x.is_floating_point():
        from torch._decomp import decomposition_table

        op = aten.max_pool2d_with_indices.default if nd == 2 else aten.max_pool3d_with_indices.default
        return decomposition_table[op](x, kernel_size, stride, padding, dilation, ceil_mode)
    dims = _pool_geometry(x, nd, kernel_size, stride, padding, dilation, ceil_mode)
    padded = _pad_spatial(x, dims, float("-inf"))
    sizes = x.shape[-nd:]
    best = index = None
    for offsets in itertools.product(*(range(k) for k, *_ in dims)):
        view, here = padded, None
        for axis, ((k, s, p, d, out, extra), i, size) in enumerate(zip(dims, offsets, sizes)):
            dim = x.dim() - nd + axis
            view = aten.slice(view, dim, i * d, i * d + s * (out - 1) + 1, s)
            position = torch.arange(out, device=x.device) * s - p + i * d  # along this axis, in the input
            shape = [1] * nd
            shape[axis] = out
            position = position.reshape(shape)
            here = position if here is None else here * size + position
        here = here.expand(view.shape)
        if best is None:
            best, index = view, here
            continue
        larger = (view > best) | torch.isnan(view)
        best, index = torch.where(larger, view, best), torch.where(larger, here, index)
    return best, index


def _max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode, nd=2)


def _max_pool3d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode, nd=3)


def _avg_pool_divisor(dims, sizes, count_include_pad: bool, dtype):
    """Eager's divisor of each output position: the window clipped to the padded input (count_include_pad)
    or to the input itself; a number where every window has the same, else a tensor over the spatial dims
    (made of aranges, which the compiler folds into a constant)."""
    counts = []
    for (k, s, p, d, out, extra), size in zip(dims, sizes):
        start = np.arange(out) * s - p
        end = np.minimum(start + k, size + p)
        if not count_include_pad:
            end, start = np.minimum(end, size), np.maximum(start, 0)
        counts.append(end - start)
    if all(len(set(c.tolist())) == 1 for c in counts):
        return float(np.prod([c[0] for c in counts]))
    divisor = None
    for axis, ((k, s, p, d, out, extra), size) in enumerate(zip(dims, sizes)):
        start = torch.arange(out) * s - p
        end = torch.clamp(start + k, max=size + p)
        if not count_include_pad:
            end, start = torch.clamp(end, max=size), torch.clamp(start, min=0)
        shape = [1] * len(dims)
        shape[axis] = out
        count = (end - start).reshape(shape)
        divisor = count if divisor is None else divisor * count
    return divisor.to(dtype)


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, *, nd):
    """Average pooling: window sums, each spatial dim in turn (a sum of the window's strided views of the zero
    padded input), divided by eager's divisor (divisor_override, or the window's size clipped as eager
    clips it). torch-mlir's own lowering ignores divisor_override and cuts ceil_mode's last window
    differently from eager: silently wrong results; its plain form is kept. bf16/fp16 sum in fp32 and round once,
    as ATen's kernels accumulate (a window of 36 summed in bf16 steps was off by 2.5%)."""
    dims = _pool_geometry(x, nd, kernel_size, stride, padding, 1, ceil_mode)
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    total = _pad_spatial(wide, dims, 0.0)
    for axis, (k, s, p, d, out, extra) in enumerate(dims):
        dim = x.dim() - nd + axis
        views = [aten.slice(total, dim, i, i + s * (out - 1) + 1, s) for i in range(k)]
        total = functools.reduce(torch.add, views)
    if divisor_override:
        return (total / divisor_override).to(x.dtype)
    return (total / _avg_pool_divisor(dims, x.shape[-nd:], count_include_pad, wide.dtype)).to(x.dtype)


def _needs_own_avg_pool(ceil_mode, divisor_override) -> bool:
    return bool(ceil_mode) or divisor_override is not None


def _avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if not _needs_own_avg_pool(ceil_mode, divisor_override) or not x.is_floating_point():
        return NotImplemented
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd=2)


def _avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if not x.is_floating_point():
        return NotImplemented
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd=3)


def _spread(g, dim: int, stride: int):
    """g with stride - 1 zeros between its elements along dim: g[j] lands at j * stride (a pad, a reshape
    and a slice, where a strided scatter would be a scatter)."""
    if stride == 1:
        return g
    n = g.shape[dim]
    g = g.unsqueeze(dim + 1)
    pads = [0, 0] * (g.dim() - 1 - (dim + 1)) + [0, stride - 1]
    g = aten.constant_pad_nd(g, pads, 0.0)
    g = g.reshape(*g.shape[:dim], n * stride, *g.shape[dim + 2:])
    return aten.slice(g, dim, 0, stride * (n - 1) + 1)


def _avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, *, nd):
    """The adjoint of `_avg_pool`, one spatial dim at a time (the window sum is separable): each output's
    gradient over its divisor, spread to its window's start and summed over the window's offsets, then the
    padding cut off. (torch-mlir cannot lower avg_pool{2,3}d_backward.)"""
    dims = _pool_geometry(x, nd, kernel_size, stride, padding, 1, ceil_mode)
    divisor = divisor_override or _avg_pool_divisor(dims, x.shape[-nd:], count_include_pad, grad.dtype)
    g = grad / divisor
    for axis, ((k, s, p, d, out, extra), size) in enumerate(zip(dims, x.shape[-nd:])):
        dim = x.dim() - nd + axis
        spread = _spread(g, dim, s)
        length = size + 2 * p + extra
        total = None
        for i in range(k):
            pads = [0, 0] * (x.dim() - 1 - dim) + [i, length - i - spread.shape[dim]]
            shifted = aten.constant_pad_nd(spread, pads, 0.0)
            total = shifted if total is None else total + shifted
        g = aten.slice(total, dim, p, p + size)
    return g


def _avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                              nd=2)


def _avg_pool3d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                              nd=3)


def _max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Each output's gradient added at the input position its index names (a scatter-add over the
    flattened spatial dims)."""
    batch = x.shape[:-3]
    flat_grad = grad.reshape(*batch, -1)
    flat_index = indices.reshape(*batch, -1)
    spatial = x.shape[-3] * x.shape[-2] * x.shape[-1]
    total = torch.zeros(*batch, spatial, dtype=grad.dtype, device=grad.device).scatter_add(-1, flat_index, flat_grad)
    return total.reshape(x.shape)


def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """x with src written over x[start:end:step] along dim (the backward of a slice, e.g. RoPE's rotate_half):
    with step 1 the untouched parts and src concatenated; with a step, src spread to every step-th position
    (a pad and a reshape) and selected where the slice lies. torch's own decomposition gathers from src
    through an index per element; torch-mlir does not lower the op itself."""
    dim = dim % x.dim() if x.dim() else 0
    size = x.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    count = max(0, (end - start + step - 1) // step)
    if count == 0:
        return x.clone()
    shape = list(x.shape)
    shape[dim] = count
    src = src.expand(shape).to(x.dtype)
    if step == 1:
        parts = [aten.slice(x, dim, 0, start), src, aten.slice(x, dim, end, size)]
        return torch.cat([p for p in parts if p.shape[dim] > 0], dim)
    spread = _spread(src, dim, step)
    after = size - start - spread.shape[dim]
    placed = aten.constant_pad_nd(spread, [0, 0] * (x.dim() - 1 - dim) + [start, after], 0.0)
    position = torch.arange(size, device=x.device)
    inside = (position >= start) & (position < start + spread.shape[dim]) & ((position - start) % step == 0)
    mask_shape = [1] * x.dim()
    mask_shape[dim] = size
    return torch.where(inside.reshape(mask_shape), placed, x)


def _logaddexp(a, b):
    """log(exp(a) + exp(b)) without overflow: the larger plus log1p of the smaller's share (a == b, infinities
    included, is a + log 2)."""
    larger = torch.maximum(a, b)
    return torch.where(a == b, a + math.log(2.0), larger + torch.log1p(torch.exp(-torch.abs(a - b))))


def _logcumsumexp(x, dim):
    """Running log-sum-exp as a scan of log-sum-exp (:func:`_scan`). torch-mlir lowers it as
    log(cumsum(exp(x))), which overflows to inf for inputs above ~88 (float32): silently wrong results."""
    return _scan(x, dim, _logaddexp, float("-inf"))



# --- ops torch-mlir cannot lower, found by benchmarks/opinfo.py (issue 21, part 2) ---------------------------------


def _zeros(size, dtype, device):
    """Zeros from a scalar (torch.zeros itself decomposes into empty and a fill: it cannot make `_empty`)."""
    return torch.scalar_tensor(0, dtype=dtype or torch.get_default_dtype(), device=device).expand(size).clone()


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """An uninitialised tensor: its values are unspecified, so zeros are one correct choice (a splat constant to
    the compiler). torch-mlir has no lowering of tensor.empty to StableHLO."""
    return _zeros(size, dtype, device)


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _zeros(size, dtype, device)


def _diagonal_geometry(shape, offset: int, dim1: int, dim2: int) -> tuple:
    """(dim1, dim2, rows, cols, length, start): the diagonal's length and the flat index of its first element
    in the [rows * cols] flattening of the two dims (moved last); each next element is cols + 1 further."""
    rank = len(shape)
    dim1, dim2 = dim1 % rank, dim2 % rank
    rows, cols = shape[dim1], shape[dim2]
    length = max(0, min(rows, cols - offset) if offset >= 0 else min(rows + offset, cols))
    start = offset if offset >= 0 else -offset * cols
    return dim1, dim2, rows, cols, length, start


def _diagonal(x, offset=0, dim1=0, dim2=1):
    """The diagonal of two dims as a strided slice: the dims moved last and flattened, the elements cols + 1
    apart from the first (a view torch expresses with as_strided, which torch-mlir cannot lower)."""
    dim1, dim2, rows, cols, length, start = _diagonal_geometry(x.shape, offset, dim1, dim2)
    moved = x.movedim((dim1, dim2), (-2, -1))
    batch = moved.shape[:-2]
    if length == 0:
        return _zeros((*batch, 0), x.dtype, x.device)
    flat = moved.reshape(*batch, rows * cols)
    return aten.slice(flat, -1, start, start + (length - 1) * (cols + 1) + 1, cols + 1)


def _place_diagonal(src, shape, offset, dim1, dim2):
    """(placed, mask): `src` written on the diagonal of a zero tensor of `shape`, and where the diagonal lies."""
    dim1, dim2, rows, cols, length, start = _diagonal_geometry(shape, offset, dim1, dim2)
    batch = [s for d, s in enumerate(shape) if d not in (dim1, dim2)]
    moved_shape = (*batch, rows, cols)
    last = len(batch)
    spread = _spread(src.reshape(*batch, length), last, cols + 1)
    after = rows * cols - start - spread.shape[last]
    flat = aten.constant_pad_nd(spread, [start, after], 0)
    position = torch.arange(rows * cols, device=src.device)
    inside = (position >= start) & (position < start + spread.shape[last]) & ((position - start) % (cols + 1) == 0)
    placed = flat.reshape(moved_shape).movedim((-2, -1), (dim1, dim2))
    mask = inside.reshape(rows, cols)
    mask = mask.reshape([1] * len(batch) + [rows, cols]).movedim((-2, -1), (dim1, dim2))
    return placed, mask


def _diagonal_backward(grad, input_sizes, offset, dim1, dim2):
    """The adjoint of `_diagonal`: the gradient spread cols + 1 apart into zeros (a pad and a reshape)."""
    if _diagonal_geometry(input_sizes, offset, dim1, dim2)[4] == 0:
        return _zeros(input_sizes, grad.dtype, grad.device)
    return _place_diagonal(grad, tuple(input_sizes), offset, dim1, dim2)[0]


def _diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    if _diagonal_geometry(x.shape, offset, dim1, dim2)[4] == 0:
        return x.clone()
    placed, mask = _place_diagonal(src.to(x.dtype), tuple(x.shape), offset, dim1, dim2)
    return torch.where(mask, placed, x)


def _unfold(x, dimension, size, step):
    """Windows of `size` elements every `step` along `dimension`, as a new last dim: one strided slice per
    position in the window, stacked (torch expresses the view with as_strided, which torch-mlir cannot lower)."""
    if x.dim() == 0:
        return x.reshape(1)
    dim = dimension % x.dim()
    count = (x.shape[dim] - size) // step + 1
    views = [aten.slice(x, dim, i, i + step * (count - 1) + 1, step) for i in range(size)]
    return torch.stack(views, -1)


def _unfold_backward(grad, input_sizes, dim, size, step):
    """The adjoint of `_unfold`: each window position's gradient spread `step` apart, shifted to its offset and
    summed."""
    if len(input_sizes) == 0:
        return grad.reshape(())
    dim = dim % len(input_sizes)
    length = input_sizes[dim]
    total = None
    for i in range(size):
        spread = _spread(grad.select(-1, i), dim, step)
        pads = [0, 0] * (len(input_sizes) - 1 - dim) + [i, length - i - spread.shape[dim]]
        shifted = aten.constant_pad_nd(spread, pads, 0)
        total = shifted if total is None else total + shifted
    return total


def _scan(x, dim: int, combine, identity):
    """Inclusive scan of `combine` along `dim` over doubling strides (Hillis-Steele: ceil(log2 n) elementwise
    steps, each combining x with itself shifted by the stride, the identity shifted in). A bf16 or fp16 scan
    combines in fp32 and rounds each result once, as eager's kernels accumulate (a bf16 cumprod combined in bf16:
    70% of its elements differed from eager)."""
    if x.dtype in _REDUCED_FLOATS:
        return _scan(x.float(), dim, combine, identity).to(x.dtype)
    if x.dim() == 0:
        return x.clone()
    dim = dim % x.dim()
    n = x.shape[dim]
    stride = 1
    while stride < n:
        pads = [0, 0] * (x.dim() - 1 - dim) + [stride, 0]
        shifted = aten.slice(aten.constant_pad_nd(x, pads, identity), dim, 0, n)
        x = combine(x, shifted)
        stride *= 2
    return x


def _cumprod(x, dim, *, dtype=None):
    """Running product as a scan of multiplications (torch-mlir cannot lower cumprod); integers and bools
    multiply in int64, as eager's."""
    if dtype is not None:
        x = x.to(dtype)
    elif not x.is_floating_point() and not x.is_complex():
        x = x.to(torch.int64)
    return _scan(x, dim, torch.mul, 1)


# Special functions as documented approximations built of exp, log, sin, tan and arithmetic (torch-mlir lowers none
# of them). Each is tested against eager in tests/test_op_coverage.py on wide ranges of inputs.

# Numerical Recipes in C (2nd ed.) 6.2, erfcc: a Chebyshev fit of erfc with fractional error < 1.2e-7 everywhere.
_ERFC_COEFFICIENTS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
                      1.48851587, -0.82215223, 0.17087277)


def _erfc(x):
    """erfc(x) = 1 - erf(x) with a small relative error where erfc is tiny (1 - erf(x) would be 0 there)."""
    z = torch.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = torch.full_like(t, _ERFC_COEFFICIENTS[-1])
    for c in reversed(_ERFC_COEFFICIENTS[:-1]):
        poly = c + t * poly
    tail = t * torch.exp(-z * z + poly)
    return torch.where(x >= 0, tail, 2.0 - tail)


# Numerical Recipes in C (2nd ed.) 6.1, gammln: Lanczos' series with gamma = 5, six terms, error < 2e-10.
_LANCZOS = (76.18009172947146, -86.50532032941677, 24.01409824083091, -1.231739572450155, 0.1208650973866179e-2,
            -0.5395239384953e-5)


def _lgamma_positive(x):
    """log(Gamma(x)) for x >= 0.5 (Lanczos)."""
    series = torch.full_like(x, 1.000000000190015)
    for i, c in enumerate(_LANCZOS):
        series = series + c / (x + (i + 1))
    t = x + 5.5
    return (x + 0.5) * torch.log(t) - t + torch.log(2.5066282746310005 * series / x)


def _lgamma(x):
    """log|Gamma(x)|: Lanczos for x >= 0.5, Euler's reflection log(pi / |sin(pi x)|) - lgamma(1 - x) below (the
    sine of the fractional part, exact in float, so large negative x keep their accuracy); +inf at the poles
    (0, -1, -2, ...) and at +-inf, as eager's."""
    low = x < 0.5
    y = torch.where(low, 1.0 - x, x)
    main = _lgamma_positive(y)
    fraction = x - torch.floor(x)
    reflected = math.log(math.pi) - torch.log(torch.abs(torch.sin(math.pi * fraction))) - main
    result = torch.where(low, reflected, main)
    return torch.where(torch.isinf(x), torch.full_like(x, math.inf), result)


def _digamma(x):
    """psi(x): for x >= 0.5 the recurrence psi(x) = psi(x + 1) - 1/x up to x >= 6, then the asymptotic series
    log x - 1/(2x) - sum B_2k / (2k x^2k) to x^-10 (error below 1e-11 there); below 0.5 the reflection
    psi(1 - x) - pi cos(pi x) / sin(pi x) (of the fractional part). -inf at 0 and NaN at the negative integers, as eager's."""
    low = x < 0.5
    y = torch.where(low, 1.0 - x, x)
    shifted = torch.zeros_like(y)
    for _ in range(6):
        small = y < 6.0
        shifted = shifted + torch.where(small, 1.0 / y, torch.zeros_like(y))
        y = torch.where(small, y + 1.0, y)
    inverse_square = 1.0 / (y * y)
    series = inverse_square * (1 / 12 - inverse_square * (1 / 120 - inverse_square * (
        1 / 252 - inverse_square * (1 / 240 - inverse_square * (1 / 132)))))
    main = torch.log(y) - 0.5 / y - series - shifted
    fraction = x - torch.floor(x)
    angle = math.pi * fraction
    reflected = main - math.pi * torch.cos(angle) / torch.sin(angle)
    result = torch.where(low, reflected, main)
    integer = low & (fraction == 0)
    pole = torch.where(1.0 / x > 0, -math.inf, math.inf)  # at 0 (-inf; +inf at -0.0, as eager's)
    result = torch.where(integer, torch.where(x == 0, pole, math.nan), result)
    return torch.where(x == math.inf, x, result)



_BERNOULLI = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66)  # B_2, B_4, ..., B_10
# The series' first omitted term, B_12 (n + 11)! / (12! (n - 1)! 10^12) of the leading one, is 1.3e-8 at n = 8
# (1e-10 at n = 4: polygamma(3, x)'s gradient); past it the order is left to torch-mlir, which refuses it by name.
_POLYGAMMA_MAX_ORDER = 8


def _cot_derivative(x, n: int):
    """The n-th derivative (n = 1, 2, 3) of cot(pi x), from the sine and cosine of pi times x's fractional part."""
    if n > 3:
        return _cot_derivative_polynomial(x, n)
    angle = math.pi * (x - torch.floor(x))
    csc2 = 1.0 / torch.sin(angle) ** 2
    cot = torch.cos(angle) / torch.sin(angle)
    if n == 1:
        return -math.pi * csc2
    if n == 2:
        return 2 * math.pi ** 2 * csc2 * cot
    return -2 * math.pi ** 3 * csc2 * (2 * cot * cot + csc2)


def _polygamma(n, x):
    """psi^(n)(x) for n = 1 .. 8 (n = 0 is digamma): for x >= 0.5 the recurrence psi^(n)(x) = psi^(n)(x + 1) +
    (-1)^(n+1) n! / x^(n+1) up to x >= 10, then the asymptotic series (-1)^(n+1) [(n-1)!/x^n + n!/(2x^(n+1)) +
    sum B_2k (2k+n-1)! / ((2k)! x^(2k+n))] to B_10 (Abramowitz and Stegun 6.4.11; error below 1e-10 there);
    below 0.5 the reflection psi^(n)(x) = (-1)^n psi^(n)(1 - x) - pi d^n/dx^n cot(pi x). Infinite at the poles
    0, -1, -2, ..., as eager's. Larger n is left to torch-mlir, which refuses it by name."""
    if n == 0:
        return _digamma(x)
    if not 1 <= n <= _POLYGAMMA_MAX_ORDER or not x.is_floating_point():
        return NotImplemented
    low = x < 0.5
    y = torch.where(low, 1.0 - x, x)
    total = torch.zeros_like(y)
    for _ in range(10):
        small = y < 10.0
        total = total + torch.where(small, 1.0 / y ** (n + 1), torch.zeros_like(y))
        y = torch.where(small, y + 1.0, y)
    tail = math.factorial(n - 1) / y ** n + math.factorial(n) / (2 * y ** (n + 1))
    for k, b in enumerate(_BERNOULLI, start=1):
        tail = tail + b * math.factorial(2 * k + n - 1) / math.factorial(2 * k) / y ** (2 * k + n)
    main = (-1) ** (n + 1) * (math.factorial(n) * total + tail)
    reflected = (-1) ** n * main - math.pi * _cot_derivative(x, n)
    result = torch.where(low, reflected, main)
    pole = low & (x == torch.floor(x))
    return torch.where(pole, torch.full_like(x, (-1) ** (n + 1) * math.inf), result)

def _lowest(dtype):
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _highest(dtype):
    return math.inf if dtype.is_floating_point else torch.iinfo(dtype).max


def _region_mask(region_shape, shape, device):
    """Where a tensor of `region_shape` lies in one of `shape` that it starts (a boolean of `shape`)."""
    inside = None
    for axis, (part, whole) in enumerate(zip(region_shape, shape)):
        if part == whole:
            continue
        here = (torch.arange(whole, device=device) < part).reshape([whole if a == axis else 1 for a in range(len(shape))])
        inside = here if inside is None else inside & here
    return inside


def _scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    """x with src's elements combined (sum, prod, mean, amax, amin) into the positions `index` names along dim.
    Dense: a one-hot of each index against every position of dim ([.., N, M, ..]), the masked sources reduced
    over M, combined with x's values (include_self) where any index lands. torch-mlir lowers no scatter_reduce;
    its memory grows as N * M, which suits the index sizes of scatter_reduce's uses, not an embedding table."""
    if x.dim() == 0:
        x, index, src = x.reshape(1), index.reshape(1), src.reshape(1)
        return _scatter_reduce(x, 0, index, src, reduce, include_self=include_self).reshape(())
    d = dim % x.dim()
    region = tuple(index.shape)
    if index.numel() == 0:
        return x.clone()
    src = src[tuple(slice(0, n) for n in region)].to(x.dtype)
    base = x[tuple(slice(None) if a == d else slice(0, n) for a, n in enumerate(region))]
    n = x.shape[d]
    index = torch.where(index < 0, index + n, index)
    positions = torch.arange(n, device=x.device).reshape([n if a == d else 1 for a in range(x.dim() + 1)])
    member = index.unsqueeze(d) == positions  # [.., N, M, ..]: N at d, M at d + 1
    values = src.unsqueeze(d)
    count = member.sum(d + 1)
    landed = count > 0
    if reduce in ("sum", "mean"):
        reduced = torch.where(member, values, torch.scalar_tensor(0, dtype=x.dtype)).sum(d + 1).to(x.dtype)
    elif reduce == "prod":
        reduced = torch.where(member, values, torch.scalar_tensor(1, dtype=x.dtype)).prod(d + 1).to(x.dtype)
    elif reduce == "amax":
        reduced = torch.where(member, values, torch.scalar_tensor(_lowest(x.dtype), dtype=x.dtype)).amax(d + 1)
    elif reduce == "amin":
        reduced = torch.where(member, values, torch.scalar_tensor(_highest(x.dtype), dtype=x.dtype)).amin(d + 1)
    else:
        raise ValueError(f"scatter_reduce: unknown reduce {reduce!r}")
    if reduce == "mean":
        total, count = (base + reduced, count + 1) if include_self else (reduced, count)
        divisor = count.clamp(min=1).to(x.dtype)
        combined = total / divisor if x.is_floating_point() else torch.div(total, divisor, rounding_mode="floor")
    elif not include_self:
        combined = reduced
    elif reduce == "sum":
        combined = base + reduced
    elif reduce == "prod":
        combined = base * reduced
    elif reduce == "amax":
        combined = torch.maximum(base, reduced)
    else:
        combined = torch.minimum(base, reduced)
    result = torch.where(landed, combined.to(x.dtype), base)
    inside = _region_mask(result.shape, x.shape, x.device)
    if inside is None:
        return result
    pads = []
    for part, whole in reversed(list(zip(result.shape, x.shape))):
        pads += [0, whole - part]
    return torch.where(inside, aten.constant_pad_nd(result, pads, 0), x)


def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """index_reduce as scatter_reduce: each slice source[.., i, ..] goes to x[.., index[i], ..]."""
    d = dim % x.dim() if x.dim() else 0
    shape = [source.shape[a] if a == d else 1 for a in range(source.dim())] if source.dim() else []
    full = index.reshape(shape).expand(source.shape) if source.dim() else index.reshape(())
    return _scatter_reduce(x, d, full, source, reduce, include_self=include_self)


def _fmax(a, b):
    """The larger, NaN only where both are (torch-mlir lowers fmax only for operands of one shape)."""
    if not a.is_floating_point():
        return torch.maximum(a, b)
    return torch.where(torch.isnan(b), a, torch.where(torch.isnan(a), b, torch.maximum(a, b)))


def _fmin(a, b):
    if not a.is_floating_point():
        return torch.minimum(a, b)
    return torch.where(torch.isnan(b), a, torch.where(torch.isnan(a), b, torch.minimum(a, b)))


def _reduce_with_index_of_scalar(reduce):
    """max.dim / min.dim of a 0-d tensor: the value and index 0 (torch-mlir cannot lower the 0-d form). Of a bool
    tensor: the same reduction of its 0/1 as int32, converted back (torch-mlir's bool reduction starts from the
    wrong value: a column of False gave True and the index n, one past the end; cumprod's backward scatters at that
    index)."""
    def lowering(x, dim=0, keepdim=False):
        if x.dtype == torch.bool and x.dim() != 0:
            values, indices = reduce(x.to(torch.int32), dim, keepdim)
            return values.to(torch.bool), indices
        if x.dim() != 0:
            return NotImplemented
        return x.clone(), torch.scalar_tensor(0, dtype=torch.int64, device=x.device)
    return lowering


def _bool_extreme(reduce):
    """amax / amin of a bool tensor, on its 0/1 as int32 (see _reduce_with_index_of_scalar); others torch-mlir's."""
    def lowering(x, dim=(), keepdim=False):
        if x.dtype != torch.bool:
            return NotImplemented
        return reduce(x.to(torch.int32), dim, keepdim).to(torch.bool)
    return lowering


def _cumulative_extreme(x, dim, beats):
    """cummax / cummin: a scan of (value, index) pairs over doubling strides; an earlier pair is kept only where
    it beats the later one (`beats`: strictly larger or smaller, NaN beating numbers), so ties and repeated NaNs
    take the later index, as eager's."""
    if x.dim() == 0:
        return x.clone(), torch.scalar_tensor(0, dtype=torch.int64, device=x.device)
    dim = dim % x.dim()
    n = x.shape[dim]
    index = torch.arange(n, device=x.device).reshape([n if a == dim else 1 for a in range(x.dim())]).expand(x.shape)
    stride = 1
    while stride < n:
        pads = [0, 0] * (x.dim() - 1 - dim) + [stride, 0]
        earlier = aten.slice(aten.constant_pad_nd(x, pads, 0), dim, 0, n)
        earlier_index = aten.slice(aten.constant_pad_nd(index, pads, 0), dim, 0, n)
        position = torch.arange(n, device=x.device).reshape([n if a == dim else 1 for a in range(x.dim())])
        keep = (position >= stride) & beats(earlier, x)
        x, index = torch.where(keep, earlier, x), torch.where(keep, earlier_index, index)
        stride *= 2
    return x, index


def _larger(u, v):
    return (u > v) | (torch.isnan(u) & ~torch.isnan(v)) if u.is_floating_point() else u > v


def _smaller(u, v):
    return (u < v) | (torch.isnan(u) & ~torch.isnan(v)) if u.is_floating_point() else u < v


def _cummax(x, dim):
    return _cumulative_extreme(x, dim, _larger)


def _cummin(x, dim):
    return _cumulative_extreme(x, dim, _smaller)


# -- selections by rank: median, nanmedian, kthvalue, mode ---------------------------------------------------
# Each is a stable sort (NaN the largest value: passes/indexing.py) read at a rank. ATen's CPU median/nanmedian
# partition by (value, index), so at ties they return the index a stable sort puts at that rank; kthvalue's
# quickselect returns one of the tied indices by its own pivots (not reproduced: the stable sort's is returned).

def _nan_count(x, dim=None):
    if not x.is_floating_point():
        return torch.zeros((), dtype=torch.int64, device=x.device)
    nans = torch.isnan(x)
    return nans.sum() if dim is None else nans.sum(dim, keepdim=True)


def _median_rank(n: int, nans, ignore_nan: bool):
    """The rank median (nanmedian) reads: the lower median of the numbers; median of a row with a NaN reads its
    first NaN (rank n - nans: the NaNs sort last, in order), nanmedian of all NaNs rank 0 (C++'s -1 / 2)."""
    if ignore_nan:
        return torch.div(n - 1 - nans, 2, rounding_mode="floor").clamp(min=0)
    return torch.where(nans > 0, n - nans, (n - 1) // 2)


def _whole_median(x, ignore_nan: bool):
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.full((), math.nan, dtype=x.dtype, device=x.device)
    ordered = torch.sort(flat, stable=True).values
    rank = _median_rank(n, _nan_count(flat), ignore_nan)
    return ordered.gather(0, rank.reshape(1)).reshape(())


def _median(x):
    return _whole_median(x, ignore_nan=False)


def _nanmedian(x):
    return _whole_median(x, ignore_nan=True)


def _at_rank(x, dim, keepdim, rank):
    """(values, indices) of the element of each row along dim that a stable sort puts at `rank` (a tensor of x's
    shape but 1 along dim)."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim %= x.dim()
    values, indices = torch.sort(x, dim=dim, stable=True)
    value, index = values.gather(dim, rank), indices.gather(dim, rank)
    return (value, index) if keepdim else (value.squeeze(dim), index.squeeze(dim))


def _rank_shape(x, dim):
    return [1 if d == dim % max(1, x.dim()) else s for d, s in enumerate(x.shape)]


def _first_of_equals(n: int) -> int:
    """The index libstdc++'s std::nth_element (introselect) leaves first among n elements that all compare equal:
    ATen's nanmedian of a row of n NaNs returns it (its comparator orders numbers, not NaNs among themselves). The
    swaps of introselect's median-of-three pivot and unguarded partition, replayed for a comparator always false
    (libc++, macOS's, partitions otherwise)."""
    order, first, last, depth = list(range(n)), 0, n, 2 * (n.bit_length() - 1)
    while last - first > 3 and depth > 0:  # past the depth limit a heap select, which moves nothing equal
        depth -= 1
        middle = first + (last - first) // 2
        order[first], order[middle] = order[middle], order[first]
        low, high = first + 1, last
        while True:
            high -= 1
            if low >= high:
                break
            order[low], order[high] = order[high], order[low]
            low += 1
        last = low  # the cut lies past rank 0: the first part is kept; an insertion sort moves nothing equal
    return order[0]


def _median_dim(ignore_nan: bool):
    def median_dim(x, dim=-1, keepdim=False):
        if x.dim() == 0:
            return _at_rank(x, dim, keepdim, None)
        n = x.shape[dim]
        nans = _nan_count(x, dim)
        rank = _median_rank(n, nans, ignore_nan).expand(_rank_shape(x, dim)).to(torch.int64)
        value, index = _at_rank(x, dim, True, rank.contiguous())
        if ignore_nan and x.is_floating_point():
            index = torch.where(nans == n, _first_of_equals(n), index)
        return (value, index) if keepdim else (value.squeeze(dim), index.squeeze(dim))
    return median_dim


def _kthvalue(x, k, dim=-1, keepdim=False):
    """The k-th smallest (NaN the largest value)."""
    rank = torch.full(_rank_shape(x, dim), k - 1, dtype=torch.int64, device=x.device)
    return _at_rank(x, dim, keepdim, rank)


def _mode(x, dim=-1, keepdim=False):
    """The most frequent value of each row, the smallest of equally frequent ones, and the last index holding it
    (ATen's CPU mode sorts the row, keeps the first longest run, and reports the index sorted last in it: the
    last occurrence where its sort is stable, rows of up to 16 values, insertion sort). The counts come from
    all pairs of the row (memory n x n per row)."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim %= x.dim()
    rows = x.movedim(dim, -1)
    n = rows.shape[-1]
    counts = (rows.unsqueeze(-1) == rows.unsqueeze(-2)).sum(-1)
    most = counts == counts.amax(-1, keepdim=True)
    value = torch.where(most, rows, torch.full_like(rows, _highest(x.dtype))).amin(-1, keepdim=True)
    position = torch.arange(n, device=x.device).expand(rows.shape)
    index = torch.where(rows == value, position, torch.full_like(position, -1)).amax(-1, keepdim=True)
    value, index = value.movedim(-1, dim), index.movedim(-1, dim)
    return (value, index) if keepdim else (value.squeeze(dim), index.squeeze(dim))


def _searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    """ATen's binary search (cus_lower_bound / cus_upper_bound) replayed: every value's [start, end) halved a fixed
    m.bit_length() times (enough for a row of m), each step a gather of the middle element (through the sorter) and
    ATen's own test, `!(mid >= v)` (`!(mid > v)` to the right), so NaNs land where its search puts them."""
    right = right or side == "right"
    dtype = torch.int32 if out_int32 else torch.int64
    if not isinstance(values, torch.Tensor):
        values = torch.scalar_tensor(values, dtype=sorted_sequence.dtype, device=sorted_sequence.device)
    m = sorted_sequence.shape[-1]
    if m == 0 or values.numel() == 0:
        return torch.zeros(values.shape, dtype=dtype, device=values.device)
    rows = sorted_sequence.reshape(-1, m)
    wanted = values.reshape(rows.shape[0], -1)
    order = None if sorter is None else sorter.reshape(-1, m)
    start = torch.zeros(wanted.shape, dtype=torch.int64, device=values.device)
    end = torch.full(wanted.shape, m, dtype=torch.int64, device=values.device)
    for _ in range(m.bit_length()):
        middle = start + torch.div(end - start, 2, rounding_mode="floor")
        position = middle.clamp(max=m - 1)  # a finished search (start == end == m) reads a real element, unused
        if order is not None:
            position = order.gather(1, position)
        found = rows.gather(1, position)
        onward = ~(found > wanted) if right else ~(found >= wanted)
        searching = start < end
        start = torch.where(searching & onward, middle + 1, start)
        end = torch.where(searching & ~onward, middle, end)
    return start.reshape(values.shape).to(dtype)


def _in_fp32(fn):
    """fn computed in fp32 for bf16/fp16 operands and rounded once, as ATen computes its special functions (in
    their opmath type): a series or recurrence evaluated in bf16 rounds at every step (trigamma off by 8% there)."""
    narrow = (torch.bfloat16, torch.float16)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in narrow), None)
        if dtype is None:
            return fn(*args, **kwargs)
        wide = [a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args]
        result = fn(*wide, **kwargs)
        return result if result is NotImplemented else result.to(dtype)
    return wrapped


def _flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                                      attn_mask=None, scale=None):
    """The backward of the flash attention SDPA runs on CPU tensors (what AOTAutograd records when a model
    with F.scaled_dot_product_attention trains). The probabilities are recomputed from q and k: the forward's
    decomposition returns them where the log-sum-exp would be, so the saved tensor is not relied on. Narrow
    types compute in fp32, as the CPU kernel accumulates; grouped-query heads add their gradients per group."""
    wide = torch.float32 if query.dtype in (torch.bfloat16, torch.float16) else query.dtype
    group = query.shape[1] // key.shape[1]
    q, g = query.to(wide), grad_out.to(wide)
    k, v = (t.to(wide).repeat_interleave(group, dim=1) if group > 1 else t.to(wide) for t in (key, value))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril(), -math.inf)
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(wide))
    masked_row = (scores == -math.inf).all(dim=-1, keepdim=True)  # attends to nothing: output 0, no gradient
    p = torch.where(masked_row, 0.0, torch.softmax(scores, dim=-1))
    dv = p.transpose(-2, -1) @ g
    dp = g @ v.transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
    dq = (ds @ k) * scale
    dk = (ds.transpose(-2, -1) @ q) * scale
    if group > 1:
        dk, dv = (t.unflatten(1, (key.shape[1], group)).sum(dim=2) for t in (dk, dv))
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


_SEGMENT_IDENTITY = {"sum": 0.0, "mean": 0.0, "prod": 1.0, "max": float("-inf"), "min": float("inf")}


def _segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """Reduce consecutive segments of `axis` (of the given lengths, or between offsets) as a dense mask of
    segments x positions (memory S x N x the trailing dims): each segment starts from `initial` when given;
    an empty segment's mean is `initial`, or 0/0 as eager's."""
    from neuronc.errors import NeuronCompileError

    if not data.is_floating_point() or indices is not None:
        raise NeuronCompileError("segment_reduce is lowered for floating-point data with lengths or offsets only",
                                 hint="cast the data to float32, or keep this op outside the compiled region")
    axis = axis % data.dim()
    if lengths is None:
        lengths = offsets[..., 1:] - offsets[..., :-1]
    ends = torch.cumsum(lengths, -1)
    starts = ends - lengths
    position = torch.arange(data.shape[axis], device=data.device)
    trailing = (1,) * (data.dim() - axis - 1)
    member = (starts.unsqueeze(-1) <= position) & (position < ends.unsqueeze(-1))  # lengths' shape + (N,)
    member = member.reshape(member.shape + trailing)
    picked = torch.where(member, data.unsqueeze(axis), _SEGMENT_IDENTITY[reduce])
    out = {"sum": torch.sum, "mean": torch.sum, "prod": torch.prod, "max": torch.amax, "min": torch.amin}[reduce](
        picked, axis + 1)
    if initial is not None:  # NaN propagates through clamp as through eager's max/min
        out = {"sum": torch.add, "mean": torch.add, "prod": torch.mul, "max": torch.clamp_min,
               "min": torch.clamp_max}[reduce](out, initial)
    if reduce == "mean":
        count = lengths.reshape(lengths.shape + trailing)
        out = out / count if initial is None else torch.where(count == 0, out, out / count)
    return out


def _horner(coefficients, z):
    """sum of coefficients[i] z^(n-1-i), evaluated as ATen's special functions do (from 0: c0, then * z + c)."""
    value = torch.zeros_like(z) + coefficients[0]
    for c in coefficients[1:]:
        value = value * z + c
    return value


_J1 = {  # aten/src/ATen/native/Math.h, bessel_j1_forward (Cephes j1.c)
    "PP": (7.62125616208173112003e-04, 7.31397056940917570436e-02, 1.12719608129684925192e+00,
           5.11207951146807644818e+00, 8.42404590141772420927e+00, 5.21451598682361504063e+00,
           1.00000000000000000254e+00),
    "PQ": (5.71323128072548699714e-04, 6.88455908754495404082e-02, 1.10514232634061696926e+00,
           5.07386386128601488557e+00, 8.39985554327604159757e+00, 5.20982848682361821619e+00,
           9.99999999999999997461e-01),
    "QP": (5.10862594750176621635e-02, 4.98213872951233449420e+00, 7.58238284132545283818e+01,
           3.66779609360150777800e+02, 7.10856304998926107277e+02, 5.97489612400613639965e+02,
           2.11688757100572135698e+02, 2.52070205858023719784e+01),
    "QQ": (7.42373277035675149943e+01, 1.05644886038262816351e+03, 4.98641058337653607651e+03,
           9.56231892404756170795e+03, 7.99704160447350683650e+03, 2.82619278517639096600e+03,
           3.36093607810698293419e+02),
    "RP": (-8.99971225705559398224e+08, 4.52228297998194034323e+11, -7.27494245221818276015e+13,
           3.68295732863852883286e+15),
    "RQ": (6.20836478118054335476e+02, 2.56987256757748830383e+05, 8.35146791431949253037e+07,
           2.21511595479792499675e+10, 4.74914122079991414898e+12, 7.84369607876235854894e+14,
           8.95222336184627338078e+16, 5.32278620332680085395e+18),
}


_J0 = {  # aten/src/ATen/native/Math.h, bessel_j0_forward (Cephes j0.c)
    "PP": (7.96936729297347051624e-04, 8.28352392107440799803e-02, 1.23953371646414299388e+00,
           5.44725003058768775090e+00, 8.74716500199817011941e+00, 5.30324038235394892183e+00,
           9.99999999999999997821e-01),
    "PQ": (9.24408810558863637013e-04, 8.56288474354474431428e-02, 1.25352743901058953537e+00,
           5.47097740330417105182e+00, 8.76190883237069594232e+00, 5.30605288235394617618e+00,
           1.00000000000000000218e+00),
    "QP": (-1.13663838898469149931e-02, -1.28252718670509318512e+00, -1.95539544257735972385e+01,
           -9.32060152123768231369e+01, -1.77681167980488050595e+02, -1.47077505154951170175e+02,
           -5.14105326766599330220e+01, -6.05014350600728481186e+00),
    "QQ": (6.43178256118178023184e+01, 8.56430025976980587198e+02, 3.88240183605401609683e+03,
           7.24046774195652478189e+03, 5.93072701187316984827e+03, 2.06209331660327847417e+03,
           2.42005740240291393179e+02),
    "RP": (-4.79443220978201773821e+09, 1.95617491946556577543e+12, -2.49248344360967716204e+14,
           9.70862251047306323952e+15),
    "RQ": (4.99563147152651017219e+02, 1.73785401676374683123e+05, 4.84409658339962045305e+07,
           1.11855537045356834862e+10, 2.11277520115489217587e+12, 3.10518229857422583814e+14,
           3.18121955943204943306e+16, 1.71086294081043136091e+18),
}


def _hankel(a, c: dict, offset: float, second_kind: bool):
    """Hankel's asymptotic form past 5 (ATen's far branch of J and Y): P and Q rational in (5/a)^2, the phase
    a - offset; J is P cos - Q sin, Y is P sin + Q cos, over sqrt(pi a / 2)."""
    w = 5.0 / a
    w2 = w * w
    p = _horner(c["PP"], w2) / _horner(c["PQ"], w2)
    q = w * (_horner(c["QP"], w2) / _horner(c["QQ"], w2))
    phase = a - offset
    value = p * torch.sin(phase) + q * torch.cos(phase) if second_kind else p * torch.cos(phase) - q * torch.sin(phase)
    return value * 0.797884560802865355879892119868763737 / torch.sqrt(a)


def _bessel_j0(x):
    """J0 as ATen computes it: 1 - x^2/4 below 1e-5, a rational function of x^2 up to 5, Hankel's asymptotic
    form past it; even."""
    a = x.abs()
    z = a * a
    near = (z - 5.78318596294678452118e+00) * (z - 3.04712623436620863991e+01) * _horner(_J0["RP"], z) / _horner(
        _J0["RQ"], z)
    far = _hankel(a, _J0, 0.785398163397448309615660845819875721, second_kind=False)
    return torch.where(a < 1e-5, 1.0 - z / 4.0, torch.where(a <= 5.0, near, far))


def _bessel_j1(x):
    """J1 as ATen computes it: a rational function of x^2 up to 5, Hankel's asymptotic form past it; odd."""
    a = x.abs()
    z = a * a
    near = _horner(_J1["RP"], z) / _horner(_J1["RQ"], z) * a * (z - 1.46819706421238932572e+01) * (
        z - 4.92184563216946036703e+01)
    far = _hankel(a, _J1, 2.356194490192344928846982537459627163, second_kind=False)
    value = torch.where(a <= 5.0, near, far)
    return torch.where(x < 0, -value, value)


_Y0 = {  # aten/src/ATen/native/Math.h, bessel_y0_forward (Cephes j0.c): rational part up to 5
    "YP": (1.55924367855235737965e+04, -1.46639295903971606143e+07, 5.43526477051876500413e+09,
           -9.82136065717911466409e+11, 8.75906394395366999549e+13, -3.46628303384729719441e+15,
           4.42733268572569800351e+16, -1.84950800436986690637e+16),
    "YQ": (1.04128353664259848412e+03, 6.26107330137134956842e+05, 2.68919633393814121987e+08,
           8.64002487103935000337e+10, 2.02979612750105546709e+13, 3.17157752842975028269e+15,
           2.50596256172653059228e+17),
}
_Y1 = {  # bessel_y1_forward (Cephes j1.c)
    "YP": (1.26320474790178026440e+09, -6.47355876379160291031e+11, 1.14509511541823727583e+14,
           -8.12770255501325109621e+15, 2.02439475713594898196e+17, -7.78877196265950026825e+17),
    "YQ": (5.94301592346128195359e+02, 2.35564092943068577943e+05, 7.34811944459721705660e+07,
           1.87601316108706159478e+10, 3.88231277496238566008e+12, 6.20557727146953693363e+14,
           6.87141087355300489866e+16, 3.97270608116560655612e+18),
}
_TWO_OVER_PI = 0.636619772367581343075535053490057448


def _bessel_y0(x):
    """Y0 as ATen computes it: up to 5 a rational function of x^2 plus (2/pi) log(x) J0(x) (-inf at 0, NaN below),
    Hankel's asymptotic form past it."""
    z = x * x
    near = _horner(_Y0["YP"], z) / _horner(_Y0["YQ"], z) + _TWO_OVER_PI * torch.log(x) * _bessel_j0(x)
    near = torch.where(x == 0, -math.inf, torch.where(x < 0, math.nan, near))
    return torch.where(x <= 5.0, near, _hankel(x, _J0, 0.785398163397448309615660845819875721, second_kind=True))


def _bessel_y1(x):
    """Y1 as ATen computes it: up to 5 x times a rational function of x^2 plus (2/pi)(J1(x) log(x) - 1/x) (-inf
    at 0, NaN below), Hankel's asymptotic form past it."""
    z = x * x
    near = x * (_horner(_Y1["YP"], z) / _horner(_Y1["YQ"], z)) + _TWO_OVER_PI * (
        _bessel_j1(x) * torch.log(x) - 1.0 / x)
    near = torch.where(x == 0, -math.inf, torch.where(x < 0, math.nan, near))
    return torch.where(x <= 5.0, near, _hankel(x, _J1, 2.356194490192344928846982537459627163, second_kind=True))


_I0 = {  # aten/src/ATen/native/Math.h, modified_bessel_i0_forward (Cephes): Chebyshev coefficients
    "A": (-4.41534164647933937950e-18, 3.33079451882223809783e-17, -2.43127984654795469359e-16,
          1.71539128555513303061e-15, -1.16853328779934516808e-14, 7.67618549860493561688e-14,
          -4.85644678311192946090e-13, 2.95505266312963983461e-12, -1.72682629144155570723e-11,
          9.67580903537323691224e-11, -5.18979560163526290666e-10, 2.65982372468238665035e-09,
          -1.30002500998624804212e-08, 6.04699502254191894932e-08, -2.67079385394061173391e-07,
          1.11738753912010371815e-06, -4.41673835845875056359e-06, 1.64484480707288970893e-05,
          -5.75419501008210370398e-05, 1.88502885095841655729e-04, -5.76375574538582365885e-04,
          1.63947561694133579842e-03, -4.32430999505057594430e-03, 1.05464603945949983183e-02,
          -2.37374148058994688156e-02, 4.93052842396707084878e-02, -9.49010970480476444210e-02,
          1.71620901522208775349e-01, -3.04682672343198398683e-01, 6.76795274409476084995e-01),
    "B": (-7.23318048787475395456e-18, -4.83050448594418207126e-18, 4.46562142029675999901e-17,
          3.46122286769746109310e-17, -2.82762398051658348494e-16, -3.42548561967721913462e-16,
          1.77256013305652638360e-15, 3.81168066935262242075e-15, -9.55484669882830764870e-15,
          -4.15056934728722208663e-14, 1.54008621752140982691e-14, 3.85277838274214270114e-13,
          7.18012445138366623367e-13, -1.79417853150680611778e-12, -1.32158118404477131188e-11,
          -3.14991652796324136454e-11, 1.18891471078464383424e-11, 4.94060238822496958910e-10,
          3.39623202570838634515e-09, 2.26666899049817806459e-08, 2.04891858946906374183e-07,
          2.89137052083475648297e-06, 6.88975834691682398426e-05, 3.36911647825569408990e-03,
          8.04490411014108831608e-01),
}
_I1 = {  # aten/src/ATen/native/Math.h, modified_bessel_i1_forward (Cephes): Chebyshev coefficients
    "A": (2.77791411276104639959e-18, -2.11142121435816608115e-17, 1.55363195773620046921e-16,
          -1.10559694773538630805e-15, 7.60068429473540693410e-15, -5.04218550472791168711e-14,
          3.22379336594557470981e-13, -1.98397439776494371520e-12, 1.17361862988909016308e-11,
          -6.66348972350202774223e-11, 3.62559028155211703701e-10, -1.88724975172282928790e-09,
          9.38153738649577178388e-09, -4.44505912879632808065e-08, 2.00329475355213526229e-07,
          -8.56872026469545474066e-07, 3.47025130813767847674e-06, -1.32731636560394358279e-05,
          4.78156510755005422638e-05, -1.61760815825896745588e-04, 5.12285956168575772895e-04,
          -1.51357245063125314899e-03, 4.15642294431288815669e-03, -1.05640848946261981558e-02,
          2.47264490306265168283e-02, -5.29459812080949914269e-02, 1.02643658689847095384e-01,
          -1.76416518357834055153e-01, 2.52587186443633654823e-01),
    "B": (7.51729631084210481353e-18, 4.41434832307170791151e-18, -4.65030536848935832153e-17,
          -3.20952592199342395980e-17, 2.96262899764595013876e-16, 3.30820231092092828324e-16,
          -1.88035477551078244854e-15, -3.81440307243700780478e-15, 1.04202769841288027642e-14,
          4.27244001671195135429e-14, -2.10154184277266431302e-14, -4.08355111109219731823e-13,
          -7.19855177624590851209e-13, 2.03562854414708950722e-12, 1.41258074366137813316e-11,
          3.25260358301548823856e-11, -1.89749581235054123450e-11, -5.58974346219658380687e-10,
          -3.83538038596423702205e-09, -2.63146884688951950684e-08, -2.51223623787020892529e-07,
          -3.88256480887769039346e-06, -1.10588938762623716291e-04, -9.76109749136146840777e-03,
          7.78576235018280120474e-01),
}
_K0 = {  # aten/src/ATen/native/Math.h, modified_bessel_k0_forward (Cephes): Chebyshev coefficients
    "A": (1.37446543561352307156e-16, 4.25981614279661018399e-14, 1.03496952576338420167e-11,
          1.90451637722020886025e-09, 2.53479107902614945675e-07, 2.28621210311945178607e-05,
          1.26461541144692592338e-03, 3.59799365153615016266e-02, 3.44289899924628486886e-01,
          -5.35327393233902768720e-01),
    "B": (5.30043377268626276149e-18, -1.64758043015242134646e-17, 5.21039150503902756861e-17,
          -1.67823109680541210385e-16, 5.51205597852431940784e-16, -1.84859337734377901440e-15,
          6.34007647740507060557e-15, -2.22751332699166985548e-14, 8.03289077536357521100e-14,
          -2.98009692317273043925e-13, 1.14034058820847496303e-12, -4.51459788337394416547e-12,
          1.85594911495471785253e-11, -7.95748924447710747776e-11, 3.57739728140030116597e-10,
          -1.69753450938905987466e-09, 8.57403401741422608519e-09, -4.66048989768794782956e-08,
          2.76681363944501510342e-07, -1.83175552271911948767e-06, 1.39498137188764993662e-05,
          -1.28495495816278026384e-04, 1.56988388573005337491e-03, -3.14481013119645005427e-02,
          2.44030308206595545468e+00),
}
_K1 = {  # aten/src/ATen/native/Math.h, modified_bessel_k1_forward (Cephes): Chebyshev coefficients
    "A": (-7.02386347938628759343e-18, -2.42744985051936593393e-15, -6.66690169419932900609e-13,
          -1.41148839263352776110e-10, -2.21338763073472585583e-08, -2.43340614156596823496e-06,
          -1.73028895751305206302e-04, -6.97572385963986435018e-03, -1.22611180822657148235e-01,
          -3.53155960776544875667e-01, 1.52530022733894777053e+00),
    "B": (-5.75674448366501715755e-18, 1.79405087314755922667e-17, -5.68946255844285935196e-17,
          1.83809354436663880070e-16, -6.05704724837331885336e-16, 2.03870316562433424052e-15,
          -7.01983709041831346144e-15, 2.47715442448130437068e-14, -8.97670518232499435011e-14,
          3.34841966607842919884e-13, -1.28917396095102890680e-12, 5.13963967348173025100e-12,
          -2.12996783842756842877e-11, 9.21831518760500529508e-11, -4.19035475934189648750e-10,
          2.01504975519703286596e-09, -1.03457624656780970260e-08, 5.74108412545004946722e-08,
          -3.50196060308781257119e-07, 2.40648494783721712015e-06, -1.93619797416608296024e-05,
          1.95215518471351631108e-04, -2.85781685962277938680e-03, 1.03923736576817238437e-01,
          2.72062619048444266945e+00),
}


def _chebyshev(t, coefficients):
    """Cephes' chbevl as ATen runs it: the Chebyshev series sum' c_i T_i(t / 2), by Clenshaw's recurrence."""
    b0, b1 = torch.zeros_like(t) + coefficients[0], torch.zeros_like(t)
    b2 = b1
    for c in coefficients[1:]:
        b2, b1 = b1, b0
        b0 = t * b1 - b2 + c
    return 0.5 * (b0 - b2)


def _i0_unscaled(a):
    """exp(-a) I0(a) for a >= 0: a series in a/2 - 2 up to 8, in 32/a - 2 over sqrt(a) past it."""
    return torch.where(a <= 8.0, _chebyshev(a / 2.0 - 2.0, _I0["A"]),
                       _chebyshev(32.0 / a - 2.0, _I0["B"]) / torch.sqrt(a))


def _i1_unscaled(a):
    """exp(-a) I1(a) for a >= 0, as _i0_unscaled."""
    return torch.where(a <= 8.0, _chebyshev(a / 2.0 - 2.0, _I1["A"]) * a,
                       _chebyshev(32.0 / a - 2.0, _I1["B"]) / torch.sqrt(a))


def _modified_bessel_i0(x):
    """I0 as ATen computes it (even)."""
    a = x.abs()
    return torch.exp(a) * _i0_unscaled(a)


def _modified_bessel_i1(x):
    """I1 as ATen computes it (odd)."""
    a = x.abs()
    value = torch.exp(a) * _i1_unscaled(a)
    return torch.where(x < 0, -value, value)


def _scaled_modified_bessel_i1(x):
    """special.i1e, exp(-|x|) I1(x), as ATen's calc_i1e (the same Cephes series, odd)."""
    value = _i1_unscaled(x.abs())
    return torch.where(x < 0, -value, value)


def _k_of_second_kind(x, near, far_series, scaled: bool):
    """K0 or K1 (times exp(x) if scaled): `near(x)` up to 2, exp(-x) times a series in 8/x - 2 over sqrt(x) past
    it; +inf at 0 and NaN below 0, as ATen returns them."""
    far = _chebyshev(8.0 / x - 2.0, far_series) / torch.sqrt(x)
    value = torch.where(x <= 2.0, near * torch.exp(x) if scaled else near, far if scaled else torch.exp(-x) * far)
    return torch.where(x == 0, math.inf, torch.where(x < 0, math.nan, value))


def _k0_near(x):
    return _chebyshev(x * x - 2.0, _K0["A"]) - torch.log(0.5 * x) * _modified_bessel_i0(x)


def _k1_near(x):
    return torch.log(0.5 * x) * _modified_bessel_i1(x) + _chebyshev(x * x - 2.0, _K1["A"]) / x


def _modified_bessel_k0(x):
    return _k_of_second_kind(x, _k0_near(x), _K0["B"], scaled=False)


def _modified_bessel_k1(x):
    return _k_of_second_kind(x, _k1_near(x), _K1["B"], scaled=False)


def _scaled_modified_bessel_k0(x):
    return _k_of_second_kind(x, _k0_near(x), _K0["B"], scaled=True)


def _scaled_modified_bessel_k1(x):
    return _k_of_second_kind(x, _k1_near(x), _K1["B"], scaled=True)


def _spherical_bessel_j0(x):
    """sin(x) / x as ATen computes it: its Taylor series below 0.5 (in Horner form), 0 at +-inf."""
    z = x * x
    series = 1.0 + z * _horner((1.0 / 6227020800.0, -1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0,
                                -1.0 / 6.0), z)
    value = torch.where(x.abs() < 0.5, series, torch.sin(x) / x)
    return torch.where(x.isinf(), 0.0, value)


# Orthogonal polynomials (aten/src/ATen/native/Math.h, *_polynomial_*_forward). The degree n is a tensor, so
# ATen's loop has a data-dependent trip count and the IR has no loop: neuronc unrolls the recurrence to a bound
# and selects the step equal to n. Where ATen itself stops looping this is exact: the Hermite polynomials are NaN
# past degree 128 (float), and Chebyshev's on |y| < 1 past a small degree are ATen's trigonometric closed form.
# Chebyshev's on |y| > 1 past the unrolled steps take the hyperbolic closed form (relative error ~ n*t*eps, t =
# acosh|y|; ATen's recurrence there ~ n*eps), NaN two degrees past overflow as ATen's recurrence (inf - inf).
# Laguerre and Legendre polynomials have no closed form and ATen no limit: their recurrence is unrolled to degree
# 128 (_RECURRENCE_STEPS), and a larger degree is NaN, not a number ATen would not give (a documented limit).

_CHEBYSHEV_STEPS = 16
_HERMITE_LIMIT = 128  # ATen's getHermitianLimit<float>(): a larger degree is NaN
_RECURRENCE_STEPS = 128  # Laguerre and Legendre: the degrees computed (a choice; a larger degree is NaN)
_INT64_RANGE = 2.0 ** 63  # static_cast<int64_t> of a float out of range (or NaN) is INT64_MIN on x86: degree < 0


def _polynomial_operands(x, n):
    """(x, degree as float32 integers with -1 for a NaN/inf/out-of-range n, result dtype)."""
    x = x if isinstance(x, torch.Tensor) else torch.tensor(float(x))
    n = n if isinstance(n, torch.Tensor) else torch.full_like(x, float(n))
    dtype = torch.result_type(x, n)
    dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()
    x, n = torch.broadcast_tensors(x.to(torch.float32), n.to(torch.float32))
    degree = torch.where(n.abs() < _INT64_RANGE, n.trunc(), -1.0)
    return x, degree, dtype


def _select_degree(degree, values):
    """values[k] where degree == k (values[0] at degree 0, ...); 0 elsewhere."""
    result = torch.zeros_like(values[0])
    for k, value in enumerate(values):
        result = torch.where(degree == k, value, result)
    return result


def _odd(degree):
    return degree - 2.0 * torch.floor(degree * 0.5) != 0


# kind: (degree of the first, degree above which |y| < 1 takes the closed form (plain, shifted))
_CHEBYSHEV_KINDS = {"t": (6, 6), "u": (8, 6), "v": (8, 6), "w": (8, 4)}


def _chebyshev_first(kind, y):
    return {"t": y, "u": y + y, "v": y + y - 1.0, "w": y + y + 1.0}[kind]


def _chebyshev_at_one(kind, y, n):
    """ATen's values at y = 1 and y = -1 (the polynomial's exact values there)."""
    sign = torch.where(_odd(n), -1.0, 1.0)
    twice = n + n + 1.0
    plus = {"t": torch.ones_like(n), "u": n + 1.0, "v": torch.ones_like(n), "w": twice}[kind]
    minus = {"t": sign, "u": sign * (n + 1.0), "v": sign * twice, "w": sign}[kind]
    return torch.where(y > 0, plus, minus)


def _chebyshev_trigonometric(kind, y, n, shifted):
    theta = torch.acos(y)
    sign = torch.where(_odd(n), -1.0, 1.0)
    if kind == "t":
        return torch.cos(n * theta)
    if kind == "u":
        return torch.where(torch.sin(theta) != 0, torch.sin((n + 1.0) * theta) / torch.sin(theta),
                           (n + 1.0) * torch.cos((n + 1.0) * theta) / y)
    if kind == "v":
        return torch.where(torch.sin(theta / 2.0) != 1, torch.cos((n + 0.5) * theta) / torch.cos(theta / 2.0),
                           sign * (n + n + 1.0))
    return torch.where(torch.cos(theta / 2.0) != 1, torch.sin((n + 0.5) * theta) / torch.sin(theta / 2.0),
                       sign if shifted else torch.where(y > 0, n + n + 1.0, sign))


def _chebyshev_hyperbolic(kind, y, n):
    """The polynomial at |y| > 1 as exp(n t) times a bounded ratio (t = acosh|y|): no intermediate overflow."""
    a = y.abs()
    t = torch.log1p((a - 1.0) + torch.sqrt((a - 1.0) * (a + 1.0)))
    grow = torch.exp(n * t)
    sign = torch.where((y < 0) & _odd(n), -1.0, 1.0)
    plus_v = grow * (1.0 + torch.exp(-(n + n + 1.0) * t)) / (1.0 + torch.exp(-t))  # V at |y|, W at -|y|
    plus_w = grow * torch.expm1(-(n + n + 1.0) * t) / torch.expm1(-t)  # W at |y|, V at -|y|
    if kind == "t":
        return sign * torch.exp(n * t - math.log(2.0)) * (1.0 + torch.exp(-2.0 * n * t))
    if kind == "u":
        return sign * grow * torch.expm1(-2.0 * (n + 1.0) * t) / torch.expm1(-2.0 * t)
    if kind == "v":
        return sign * torch.where(y > 0, plus_v, plus_w)
    return sign * torch.where(y > 0, plus_w, plus_v)


def _chebyshev_polynomial(kind: str, shifted: bool):
    def lowering(x, n):
        x, n, dtype = _polynomial_operands(x, n)
        y = x + x - 1.0 if shifted else x
        first = _chebyshev_first(kind, y)
        values, p, q = [torch.ones_like(y), first], torch.ones_like(y), first
        for _ in range(2, _CHEBYSHEV_STEPS + 1):
            p, q = q, (y + y) * q - p
            values.append(q)
        beyond = _chebyshev_hyperbolic(kind, y, n)
        beyond = torch.where(_chebyshev_hyperbolic(kind, y, n - 2.0).isinf(), math.nan, beyond)
        value = torch.where(n > _CHEBYSHEV_STEPS, beyond, _select_degree(n, values))
        closed_from = _CHEBYSHEV_KINDS[kind][1 if shifted else 0]
        value = torch.where((n > closed_from) & (y.abs() < 1.0), _chebyshev_trigonometric(kind, y, n, shifted), value)
        value = torch.where(y.abs() == 1.0, _chebyshev_at_one(kind, y, n), value)
        return torch.where(n < 0, 0.0, value).to(dtype)
    lowering.__name__ = f"_{'shifted_' if shifted else ''}chebyshev_polynomial_{kind}"
    return lowering


def _hermite_polynomial(physicists: bool):
    """H_n (physicists') or He_n (probabilists'): ATen's recurrence unrolled to its own limit of 128."""
    def lowering(x, n):
        x, n, dtype = _polynomial_operands(x, n)
        scale = x + x if physicists else x
        values, p, q = [torch.ones_like(x), scale], torch.ones_like(x), scale
        for k in range(1, _HERMITE_LIMIT):
            p, q = q, scale * q - (2.0 * k if physicists else float(k)) * p
            values.append(q)
        value = torch.where(n > _HERMITE_LIMIT, math.nan, _select_degree(n, values))
        return torch.where(n < 0, 0.0, value).to(dtype)
    lowering.__name__ = f"_hermite_polynomial_{'h' if physicists else 'he'}"
    return lowering


def _laguerre_polynomial_l(x, n):
    """L_n(x): ATen's recurrence (laguerre_polynomial_l_forward, its operations in its order) unrolled to degree
    128; 1 at x = 0, 0 for n < 0, NaN past degree 128."""
    x, n, dtype = _polynomial_operands(x, n)
    one_minus = 1.0 - x
    values, p, q = [torch.ones_like(x), one_minus], torch.ones_like(x), one_minus
    for k in range(1, _RECURRENCE_STEPS):
        p, q = q, ((2.0 * k + one_minus) * q - k * p) / (k + 1.0)
        values.append(q)
    value = torch.where(n > _RECURRENCE_STEPS, math.nan, _select_degree(n, values))
    value = torch.where(x == 0, 1.0, value)
    return torch.where(n < 0, 0.0, value).to(dtype)


def _legendre_polynomial_p(x, n):
    """P_n(x): ATen's recurrence (legendre_polynomial_p_forward, its operations in its order) unrolled to degree
    128; +-1 at |x| = 1, 0 for n < 0, NaN past degree 128."""
    x, n, dtype = _polynomial_operands(x, n)
    values, p, q = [torch.ones_like(x), x], torch.ones_like(x), x
    for k in range(1, _RECURRENCE_STEPS):
        p, q = q, ((2.0 * k + 1.0) * x * q - k * p) / (k + 1.0)
        values.append(q)
    value = torch.where(n > _RECURRENCE_STEPS, math.nan, _select_degree(n, values))
    value = torch.where(x.abs() == 1.0, torch.where((x > 0) | ~_odd(n), 1.0, -1.0), value)
    return torch.where(n < 0, 0.0, value).to(dtype)


# LU with partial pivoting (LAPACK's getrf: the first largest |a| of the column below the diagonal is the
# pivot; a zero column is not scaled and sets info), unrolled over the static min(m, n) columns, and what
# torch builds on it: det, slogdet, inv, solve, lu_solve, lu, lu_unpack. Row swaps are gathers and every
# product is a sum of elementwise products, so a permutation moves values exactly. torch's error check
# after inv/solve/lu_factor (`_linalg_check_errors` on `info`, raising on a singular matrix) is an effect
# that is not device work: under torch.compile it is made on the host after the program has run
# (neuronc/pytorch/host_checks.py); a .pt2 holding it is refused by the CLI (a NEFF holds device work only).

def _lu_factor(a, pivot=True):
    """(LU, pivots as int32 from 1, info as int32) of a[..., m, n]."""
    m, n = a.shape[-2], a.shape[-1]
    rows, cols = torch.arange(m, device=a.device), torch.arange(n, device=a.device)
    info = torch.zeros(a.shape[:-2], dtype=torch.int32, device=a.device)
    if a.numel() == 0:  # nothing to factor (an empty gather does not compile)
        steps = torch.arange(1, min(m, n) + 1, dtype=torch.int32, device=a.device)  # (a cumsum of nothing does not
        return a + 0, steps.expand(a.shape[:-2] + (min(m, n),)).clone(), info  # lower)
    pivots = []
    for j in range(min(m, n)):
        if pivot:
            candidates = torch.where(rows >= j, a[..., :, j].abs(), -1.0)
            p = torch.argmax(candidates, dim=-1, keepdim=True)  # [..., 1]: the first largest
            order = torch.where(rows == j, p, torch.where(rows == p, j, rows))
            a = torch.gather(a, -2, order.unsqueeze(-1).expand(a.shape))
            pivots.append(p.squeeze(-1) + 1)
        else:
            pivots.append(torch.full(a.shape[:-2], j + 1, dtype=torch.int64, device=a.device))
        diagonal = a[..., j, j]
        singular = diagonal == 0
        info = torch.where((info == 0) & singular, j + 1, info)
        below = torch.where(rows > j, a[..., :, j] / torch.where(singular, 1.0, diagonal).unsqueeze(-1), 0.0)
        right = torch.where(cols > j, a[..., j, :], 0.0)
        a = a - below.unsqueeze(-1) * right.unsqueeze(-2)
        a = torch.where((rows.unsqueeze(-1) > j) & (cols == j), below.unsqueeze(-1), a)
    if not pivots:
        return a, torch.zeros(a.shape[:-2] + (0,), dtype=torch.int32, device=a.device), info
    return a, torch.stack(pivots, -1).to(torch.int32), info


def _permutation(pivots, m: int):
    """The row order the pivots' swaps make (LU = A[order]): order[..., i] for i < m, int64."""
    order = torch.arange(m, device=pivots.device).expand(pivots.shape[:-1] + (m,))
    rows = torch.arange(m, device=pivots.device)
    for j in range(pivots.shape[-1]):
        p = pivots[..., j:j + 1].to(torch.int64) - 1
        at_j, at_p = order[..., j:j + 1], torch.gather(order, -1, p)
        order = torch.where(rows == j, at_p, torch.where(rows == p, at_j, order))
    return order


def _rows_of(b, order):
    """b[..., order, :] (order[..., m])."""
    return torch.gather(b, -2, order.unsqueeze(-1).expand(order.shape + (b.shape[-1],)))


def _inverse_order(order):
    m = order.shape[-1]
    rows = torch.arange(m, device=order.device)
    return ((order.unsqueeze(-1) == rows) * rows.unsqueeze(-1)).sum(-2)  # inverse[order[i]] = i


def _substitute(t, b, *, lower: bool, unit: bool):
    """x with t x = b, t[..., n, n] triangular, b[..., n, r]: row by row, products as sums."""
    n = t.shape[-1]
    xs = [None] * n
    for i in (range(n) if lower else range(n - 1, -1, -1)):
        known = list(range(i)) if lower else list(range(i + 1, n))
        acc = b[..., i, :]
        if known:
            solved = torch.stack([xs[k] for k in known], -2)  # [..., len, r]
            coefficients = t[..., i, known[0]:known[-1] + 1] if lower else t[..., i, i + 1:]
            acc = acc - (coefficients.unsqueeze(-1) * solved).sum(-2)
        xs[i] = acc if unit else acc / t[..., i, i:i + 1]
    return torch.stack(xs, -2) if n else b


def _lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    if not left:
        return _lu_solve(lu, pivots, b.mT, left=True, adjoint=not adjoint).mT
    batch = torch.broadcast_shapes(lu.shape[:-2], b.shape[:-2])
    lu, b = lu.expand(batch + lu.shape[-2:]), b.expand(batch + b.shape[-2:])
    if b.numel() == 0:  # nothing to solve for (an empty gather does not compile)
        return b.new_zeros(b.shape)
    order = _permutation(pivots.expand(batch + pivots.shape[-1:]), lu.shape[-1])
    if not adjoint:
        y = _substitute(lu, _rows_of(b, order), lower=True, unit=True)
        return _substitute(lu, y, lower=False, unit=False)
    y = _substitute(lu.mT, b, lower=True, unit=False)
    z = _substitute(lu.mT, y, lower=False, unit=True)
    return _rows_of(z, _inverse_order(order))


def _linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    """X with A X = B (X A = B with left=False: A^T X^T = B^T), reading only A's triangle: substitution row by row
    (linalg.lu's backward asks for it)."""
    if not left:
        return _linalg_solve_triangular(a.mT, b.mT, upper=not upper, unitriangular=unitriangular).mT
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = a.expand(batch + a.shape[-2:]), b.expand(batch + b.shape[-2:])
    if b.numel() == 0:  # nothing to solve for (an empty gather does not compile)
        return b.new_zeros(b.shape)
    return _substitute(a, b, lower=not upper, unit=unitriangular)


def _linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    return _lu_factor(a, pivot)


def _linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    return _lu_solve(lu, pivots, b, left=left, adjoint=adjoint)


def _swaps_sign(pivots):
    steps = torch.arange(1, pivots.shape[-1] + 1, device=pivots.device)
    swaps = (pivots != steps).sum(-1)
    return 1.0 - 2.0 * (swaps % 2).to(torch.float32)


def _linalg_det(a):
    """det(A) = det(A^T): ATen factors A^T (its LU and pivots, returned for the backward, are those)."""
    lu, pivots, _ = _lu_factor(a.mT)
    det = torch.diagonal(lu, 0, -2, -1).prod(-1) * _swaps_sign(pivots).to(a.dtype)
    return det, lu, pivots


def _linalg_slogdet(a):
    lu, pivots, _ = _lu_factor(a.mT)
    diagonal = torch.diagonal(lu, 0, -2, -1)
    sign = torch.sign(diagonal).prod(-1) * _swaps_sign(pivots).to(a.dtype)
    return sign, diagonal.abs().log().sum(-1), lu, pivots


def _linalg_inv_ex(a, *, check_errors=False):
    lu, pivots, info = _lu_factor(a)
    identity = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand(a.shape)
    return _lu_solve(lu, pivots, identity), info


def _linalg_solve_ex(a, b, *, left=True, check_errors=False):
    lu, pivots, info = _lu_factor(a)
    vector = b.dim() == 1 or (b.dim() == a.dim() - 1 and b.shape == a.shape[:-1])
    rhs = (b.unsqueeze(-1) if left else b.unsqueeze(-2)) if vector else b
    result = _lu_solve(lu, pivots, rhs, left=left)
    return (result.squeeze(-1) if left else result.squeeze(-2)) if vector else result, lu, pivots, info


def _unpacked(lu, pivots):
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    lower = torch.tril(lu[..., :, :k], -1) + torch.eye(m, k, dtype=lu.dtype, device=lu.device)
    upper = torch.triu(lu[..., :k, :])
    order = _permutation(pivots, m)
    permutation = (torch.arange(m, device=lu.device).unsqueeze(-1) == order.unsqueeze(-2)).to(lu.dtype)
    return permutation, lower, upper


def _linalg_lu(a, *, pivot=True):
    lu, pivots, _ = _lu_factor(a, pivot)
    return _unpacked(lu, pivots)


def _lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    permutation, lower, upper = _unpacked(lu, pivots)
    nothing = lu.new_zeros((0,))
    return (permutation if unpack_pivots else nothing, lower if unpack_data else nothing,
            upper if unpack_data else nothing)


# -- PyTorch's inference fast paths of nn.MultiheadAttention and nn.TransformerEncoderLayer -------------------

def _fast_path_softmax(scores, mask, mask_type):
    """ATen's masked_softmax of the fast path: a mask of any dtype counts as boolean (nonzero = hidden, so an
    additive -inf mask hides and a 0 shows); type 0 is [L, L], 1 a key-padding [B, L], 2 [B, H, L, L]; a row
    with every key hidden gives zeros (not NaN)."""
    if mask is None:
        return torch.softmax(scores, -1)
    hidden = mask if mask.dtype == torch.bool else mask != 0
    if mask_type == 1 or (mask_type is None and hidden.dim() == 2 and hidden.shape[0] == scores.shape[0]
                          and hidden.shape != scores.shape[-2:]):
        hidden = hidden[:, None, None, :]
    probabilities = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    return torch.where(hidden.all(-1, keepdim=True), 0.0, probabilities)


def _native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                 proj_bias, mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    """aten._native_multi_head_attention (batch-first [B, T, D], as nn.MultiheadAttention's fast path calls it)."""
    head_dim = embed_dim // num_head
    weights, biases = qkv_weight.chunk(3), qkv_bias.chunk(3)

    def heads(x, i):  # [B, T, D] -> [B, H, T, head_dim]
        projected = torch.nn.functional.linear(x, weights[i], biases[i])
        return projected.view(x.shape[0], x.shape[1], num_head, head_dim).transpose(1, 2)

    q = heads(query, 0) / math.sqrt(head_dim)
    scores = q @ heads(key, 1).transpose(-2, -1)
    probabilities = _fast_path_softmax(scores, mask, mask_type)
    context = (probabilities @ heads(value, 2)).transpose(1, 2).reshape(query.shape[0], query.shape[1], embed_dim)
    output = torch.nn.functional.linear(context, proj_weight, proj_bias)
    if not need_weights:
        return output, torch.empty(0, dtype=query.dtype, device=query.device)
    return output, probabilities.mean(1) if average_attn_weights else probabilities


def _transformer_encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                               norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1,
                               ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    """aten._transformer_encoder_layer_fwd: nn.TransformerEncoderLayer in inference, as ATen's C++ computes it."""
    F = torch.nn.functional

    def norm(x, weight, bias):
        return F.layer_norm(x, (embed_dim,), weight, bias, eps)

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = _native_multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                     mask, False, True, mask_type)[0] + src
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
    x = F.linear(F.gelu(hidden) if use_gelu else F.relu(hidden), ffn_weight_2, ffn_bias_2) + residual
    return x if norm_first else norm(x, norm_weight_2, norm_bias_2)


# -- foreach ops (the multi-tensor form optimizers use): one elementwise op per list element ------------------

_FOREACH_TARGETS = {"norm": aten.linalg_vector_norm, "zero": aten.zeros_like, "copy": aten.copy}
_FOREACH_SCALAR_TARGETS = {"maximum": aten.clamp_min, "minimum": aten.clamp_max}  # as ATen's own foreach kernels
_FOREACH_KEYWORDS = {"value", "dtype"}  # keyword-only in the per-tensor op (addc*'s value, norm's dtype)


def _foreach(overload):
    """`aten._foreach_<op>.<overload>` as a list of `aten.<op>` calls: list arguments (tensors or scalars) are
    taken element by element, the rest passed to every call. Inductor lowers these natively; torch-mlir has
    no lowering, and torch's table no decomposition."""
    base = overload._schema.name.removeprefix("aten::_foreach_")
    scalar_form = overload._overloadname in ("Scalar", "ScalarList")
    target = (scalar_form and _FOREACH_SCALAR_TARGETS.get(base)) or _FOREACH_TARGETS.get(base) or getattr(aten, base)
    arguments = overload._schema.arguments
    renamed = {"scalars": "value"} if base in ("addcmul", "addcdiv") else {}  # ScalarList: a value per element
    keyword = _FOREACH_KEYWORDS | set(renamed)
    lists = [a.name for a in arguments if a.type.kind() == "ListType" and str(a.type.getElementType()) == "Tensor"]

    def run(*args, **kwargs):
        bound = {a.name: a.default_value for a in arguments if a.has_default_value()}
        bound.update(zip((a.name for a in arguments), args))
        bound.update(kwargs)
        if overload._overloadname == "Tensor" and base in ("addcmul", "addcdiv"):  # values as a 1-D tensor
            combine = torch.mul if base == "addcmul" else torch.div
            return [x + bound["scalars"][i] * combine(a, b)
                    for i, (x, a, b) in enumerate(zip(bound["self"], bound["tensor1"], bound["tensor2"]))]
        results = []
        for i in range(len(bound[lists[0]])):
            at = {name: value[i] if isinstance(value, (list, tuple)) else value for name, value in bound.items()}
            positional = [at[a.name] for a in arguments if not a.kwarg_only and a.name not in keyword]
            keywords = {renamed.get(a.name, a.name): at[a.name] for a in arguments if a.kwarg_only or a.name in keyword}
            results.append(target(*positional, **keywords))
        return results

    return run


def _fused_multiply_add(a, b, c):
    """a * b + c, rounded twice: the engines have no fused form."""
    return a * b + c


def _addmv(self, mat, vec, *, beta=1, alpha=1):
    """beta * self + alpha * (mat @ vec), self broadcast to [rows]; with beta = 0 eager ignores self (a NaN or
    inf in it does not reach the result), so the sum leaves it out rather than multiplying it by 0."""
    product = aten.mv.default(mat, vec)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product.expand(torch.broadcast_shapes(self.shape, product.shape)).clone()
    return (self if beta == 1 else self * beta) + product


def _scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm, the fp8 matmul with tensor-wise or row-wise scales: ATen's CPU kernel scales each fp8
    operand in fp32 and multiplies them; here the fp8 operands are multiplied as they are (narrow_matmul_operands
    gives the Tensor engine fp8 x fp8 with fp32 sums) and the scales applied to the fp32 product, as a GPU does:
    the same value, rounded in another order (within fp32 of the CPU's). Then the bias, and, for an fp8
    out_dtype, the division by scale_result before the rounding (the CPU kernel reads scale_result only when
    out_dtype names an fp8 type, not when the result is fp8 by default)."""
    product = aten.mm.default(a.to(torch.float32), b.to(torch.float32))
    product = product * scale_a.float().reshape(-1, 1) * scale_b.float().reshape(1, -1)  # a row's, a column's (or one)
    if bias is not None:
        product = product + bias
    if scale_result is not None and out_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        product = product * (1 / scale_result.float())
    return product.to(out_dtype or a.dtype)


def _addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    """beta * self + alpha * sum over b of batch1[b] @ batch2[b], as one matmul contracting (b, k) (the sum of the
    products accumulates with them, in fp32 for bf16 operands). torch-mlir lowers addbmm of fp32 only; of bf16 it
    was refused. With beta = 0 eager ignores self, as _addmv."""
    batches, rows, inner = batch1.shape
    product = aten.mm.default(batch1.transpose(0, 1).reshape(rows, batches * inner),
                              batch2.reshape(batches * inner, batch2.shape[-1]))
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product.expand(torch.broadcast_shapes(self.shape, product.shape)).clone()
    return (self if beta == 1 else self * beta) + product


def _cholesky_factor(a):
    """(lower L with L L^H = a, info as int32) of a[..., n, n], column by column (Cholesky-Banachiewicz):
    column j is (a[j:, j] - L[j:, :j] L[j, :j]) / sqrt of its first element. info is eager's: the first minor
    (from 1) that is not positive definite, else 0; from there on the factor holds NaN."""
    n = a.shape[-1]
    info = torch.zeros(a.shape[:-2], dtype=torch.int32, device=a.device)
    if n == 0:  # nothing to factor
        return a.clone(), info
    columns = []
    for j in range(n):
        rest = a[..., j:, j]
        if columns:
            done = torch.stack(columns, -1)  # [..., n, j]
            rest = rest - (done[..., j:, :] * done[..., j:j + 1, :]).sum(-1)
        pivot = rest[..., 0]
        info = torch.where((info == 0) & ~(pivot > 0), j + 1, info)
        root = torch.sqrt(pivot)
        column = root.unsqueeze(-1)
        if j < n - 1:  # (an empty slice does not lower)
            column = torch.cat([column, rest[..., 1:] / column], -1)
        if j:
            column = torch.cat([torch.zeros(a.shape[:-2] + (j,), dtype=a.dtype, device=a.device), column], -1)
        columns.append(column)
    return torch.stack(columns, -1), info


def _cholesky(a, upper=False):
    """The old torch.cholesky: the lower factor, or with upper=True its transpose (U^H U = a)."""
    lower, _ = _cholesky_factor(a)
    return lower.mT if upper else lower


def _linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    """torch.linalg.cholesky's core: (factor, info); the error eager raises for info > 0 is checked after."""
    lower, info = _cholesky_factor(a)
    return (lower.mT if upper else lower), info


def _clamp_tensor(x, min=None, max=None):
    """clamp with tensor bounds: min(max(x, lo), hi) in the promoted dtype; a NaN in x or in either bound gives
    NaN (torch.maximum and minimum propagate it, as eager's kernel does), and lo > hi gives hi."""
    dtype = torch.result_type(x, min if min is not None else max)
    if min is not None and max is not None:
        dtype = torch.promote_types(dtype, torch.result_type(x, max))
    out = x.to(dtype)
    if min is not None:
        out = torch.maximum(out, min.to(dtype))
    if max is not None:
        out = torch.minimum(out, max.to(dtype))
    return out


def _put(self, index, source, accumulate=False):
    """self.flatten()[index] = source (or += with accumulate), indices into the flattened input, negative ones
    counted from its end as eager does; an index_put on the flat tensor, reshaped back."""
    flat = self.reshape(-1)
    positions = index.reshape(-1)
    positions = torch.where(positions < 0, positions + flat.shape[0], positions)
    return aten.index_put.default(flat, [positions], source.reshape(-1), accumulate).reshape(self.shape)


def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over `sumdim` of i1 * i2 * i3, each first unsqueezed at its `expand` dims (F.bilinear is
    _trilinear(x1, W, x2, [1, 3], [0], [1, 2], [2, 3])): one einsum (matrix products, not the broadcast product
    of every element), a size-1 dim that broadcasts against a wider one left out of that operand's labels."""
    total = i1.dim() + len(expand1)
    sizes = [1] * total
    labelled = []
    for t, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        dims = [d for d in range(total) if d not in expand]
        labelled.append((t, dims))
        for d, size in zip(dims, t.shape):
            sizes[d] = max(sizes[d], size)
    letters = "abcdefghijklmnopqrstuvwxyz"
    operands, specs, present = [], [], set()
    for t, dims in labelled:
        narrow = [k for k, d in enumerate(dims) if t.shape[k] == 1 and sizes[d] > 1]
        for k in reversed(narrow):
            t = t.squeeze(k)
        kept = [d for k, d in enumerate(dims) if k not in narrow]
        operands.append(t)
        specs.append("".join(letters[d] for d in kept))
        present.update(kept)
    out_dims = [d for d in range(total) if d not in sumdim]
    written = [d for d in out_dims if d in present]
    result = torch.einsum(",".join(specs) + "->" + "".join(letters[d] for d in written), *operands)
    for position, d in enumerate(out_dims):
        if d not in present:
            result = result.unsqueeze(position)
    return result


def _pdist_pairs(n: int):
    """The row pairs (i, j), i < j, in eager's order (row-major over the upper triangle), as two int64 tensors."""
    first, second = np.triu_indices(n, 1)
    return torch.from_numpy(first.astype(np.int64)), torch.from_numpy(second.astype(np.int64))


def _pdist_forward(x, p=2.0):
    """The p-norm distance of every pair of rows i < j of x[n, m]: a static gather of both rows of each pair,
    then the norm of the difference (p = 0 counts the differing elements, p = inf takes the largest)."""
    first, second = _pdist_pairs(x.shape[0])
    if first.numel() == 0:
        return x.new_zeros((0,))
    diff = (x.index_select(0, first.to(x.device)) - x.index_select(0, second.to(x.device))).abs()
    if p == 0:
        return (diff != 0).to(x.dtype).sum(-1)
    if p == 1:
        return diff.sum(-1)
    if p == 2:
        return torch.sqrt((diff * diff).sum(-1))
    if math.isinf(p):
        return diff.amax(-1)
    return diff.pow(p).sum(-1).pow(1.0 / p)


def _pdist_backward(grad, x, p, pdist):
    """Eager's gradient of pdist: per pair, d dist / d (x_i - x_j) (0 where the distance is 0), added into row i
    and subtracted from row j (two index_adds of static indices)."""
    n = x.shape[0]
    first, second = _pdist_pairs(n)
    if first.numel() == 0 or p == 0:
        return torch.zeros_like(x)
    first, second = first.to(x.device), second.to(x.device)
    diff = x.index_select(0, first) - x.index_select(0, second)
    g, dist = grad.unsqueeze(-1), pdist.unsqueeze(-1)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if p == 1:
        each = g * torch.sign(diff)
    elif p == 2:
        each = torch.where(dist == 0, zero, g * diff / dist)
    elif math.isinf(p):
        each = g * torch.sign(diff) * (diff.abs() == dist).to(x.dtype)
    elif p < 2:
        each = torch.sign(diff) * diff.abs().pow(p - 1) * g / dist.pow(p - 1)
        each = torch.where((dist == 0) | ((diff == 0) & (p < 1)), zero, each)
    else:
        each = torch.where(dist == 0, zero, diff * diff.abs().pow(p - 2) * g / dist.pow(p - 1))
    return torch.zeros_like(x).index_add(0, first, each).index_add(0, second, -each)


def _adaptive_average_matrix(size: int, out: int, dtype, device):
    """[out, size]: 1 / count over output o's window [floor(o size / out), ceil((o + 1) size / out)), else 0."""
    o = torch.arange(out, device=device).unsqueeze(-1)
    start, end = (o * size) // out, ((o + 1) * size + out - 1) // out
    i = torch.arange(size, device=device)
    inside = ((i >= start) & (i < end)).to(dtype)
    return inside / (end - start).to(dtype)


def _adaptive_avg_pool3d(x, output_size):
    """The mean over each adaptive window, dim by dim (the windows are separable): each spatial dim multiplied
    by a constant [out, in] matrix of 1 / count, as the eager device's lowering does."""
    lead = x.dim() - 3
    for i, out in enumerate(output_size):
        dim = lead + i
        weights = _adaptive_average_matrix(x.shape[dim], out, x.dtype, x.device)
        x = torch.matmul(x.movedim(dim, -1), weights.T).movedim(-1, dim)
    return x


def _adaptive_avg_pool_backward(grad, x, *, spatial: int = 3):
    """The forward's transpose: each spatial dim of the gradient multiplied by the [out, in] matrix's transpose."""
    lead = x.dim() - spatial
    for i in range(spatial):
        dim = lead + i
        weights = _adaptive_average_matrix(x.shape[dim], grad.shape[dim], grad.dtype, grad.device)
        grad = torch.matmul(grad.movedim(dim, -1), weights).movedim(-1, dim)
    return grad


def adaptive_max_pool(x, output_size):
    """(max, flat index within the image of its first occurrence) over each adaptive window: the windows'
    elements gathered dim by dim (a window shorter than the longest repeats its last element, which changes
    neither the max nor which occurrence is first), then a max over them."""
    spatial = len(output_size)
    lead = x.dim() - spatial
    sizes = x.shape[lead:]
    gathered, positions = x, None
    for i, (size, out) in enumerate(zip(sizes, output_size)):
        starts = [(o * size) // out for o in range(out)]
        ends = [-(-((o + 1) * size) // out) for o in range(out)]
        length = max(e - b for b, e in zip(starts, ends))
        o = torch.arange(out, device=x.device).unsqueeze(-1)
        start, end = (o * size) // out, ((o + 1) * size + out - 1) // out
        rows = start + torch.minimum(torch.arange(length, device=x.device), end - start - 1)  # computed, not a
        # constant tensor: torch.compile's trace cannot hold a fresh tensor made inside a decomposition
        dim = lead + 2 * i
        gathered = gathered.index_select(dim, rows.flatten()).unflatten(dim, (out, length))
        stride = int(np.prod(sizes[i + 1:]))
        here = (rows * stride).reshape([1] * (2 * i) + [out, length] + [1] * (2 * (spatial - i - 1)))
        positions = here if positions is None else positions + here
    order = list(range(lead)) + [lead + 2 * i for i in range(spatial)] + [lead + 2 * i + 1 for i in range(spatial)]
    windows = gathered.permute(order).flatten(lead + spatial)
    values, which = windows.max(-1)
    window_positions = positions.permute([2 * i for i in range(spatial)] + [2 * i + 1 for i in range(spatial)])
    window_positions = window_positions.expand(*output_size, *window_positions.shape[spatial:]).flatten(spatial)
    indices = torch.gather(window_positions.expand(*x.shape[:lead], *window_positions.shape), -1,
                           which.unsqueeze(-1)).squeeze(-1)
    return values, indices


def _adaptive_max_pool3d_backward(grad, x, indices, *, spatial: int = 3):
    """Each output's gradient added at its maximum: a scatter-add of the flat indices (within each image's
    spatial volume) into zeros shaped like x's flattened volume (overlapping windows may share a maximum)."""
    lead = x.dim() - spatial
    volume = torch.zeros(x.shape[:lead] + (math.prod(x.shape[lead:]),), dtype=grad.dtype, device=grad.device)
    return volume.scatter_add(-1, indices.flatten(lead), grad.flatten(lead)).reshape(x.shape)


def _take(x, index):
    """aten.take: x's flattened elements at ``index`` as one gather. torch's decomposition indexes with
    ``flattened[index]``, which for a 0-d index reads its value on the host (a data-dependent guard)."""
    return aten.index.Tensor(x.reshape(-1), [index])


def _empty_index(x, indices):
    """x[indices] when the result holds no element (x or an index is empty: F.pad(mode='reflect') of an empty
    batch gathers from a [0, c, w] input): torch-mlir cannot lower that gather, and there is nothing to gather,
    so the result is an empty tensor of the shape eager gives (advanced indexing's rule: the indices' broadcast
    shape in place of the indexed dims when they are adjacent, else first). Any other index is torch-mlir's."""
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    if any(i.dtype in (torch.bool, torch.uint8) for _, i in given):
        return NotImplemented  # a mask: its result's shape depends on its values
    if x.numel() != 0 and all(i.numel() != 0 for _, i in given):
        return NotImplemented
    broadcast = tuple(torch.broadcast_shapes(*(i.shape for _, i in given)))
    dims = [d for d, _ in given]
    rest = lambda ds: tuple(x.shape[d] for d in ds if d not in dims)  # noqa: E731
    if dims == list(range(dims[0], dims[-1] + 1)):
        shape = rest(range(dims[0])) + broadcast + rest(range(dims[0], x.dim()))
    else:
        shape = broadcast + rest(range(x.dim()))
    return torch.zeros(shape, dtype=x.dtype, device=x.device)


def _strided_positions(size, stride, offset=0) -> np.ndarray:
    """The storage position of each element of an as_strided(size, stride, offset) view, in row-major order."""
    positions = np.full((), offset, dtype=np.int64)
    for length, step in zip(size, stride):
        positions = positions[..., None] + np.arange(length, dtype=np.int64) * step
    return positions.reshape(-1)


def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    """x with the elements of its as_strided(size, stride, storage_offset) view replaced by src. Eager writes
    into a clone of x, which keeps x's strides when x is dense (a transposed x is laid out transposed), else is
    row-major. The positions are static, so each element of x statically takes src's element written there (or,
    for an overlapping view, which eager refuses, the last) or keeps its own: one gather and a where."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    layout = x.stride() if is_non_overlapping_and_dense_or_false(x) else torch.empty(x.shape, device="meta").stride()
    source_at = np.full(x.numel(), -1, dtype=np.int64)  # by storage position
    written_to = _strided_positions(size, stride, storage_offset or 0)
    source_at[written_to] = np.arange(written_to.size, dtype=np.int64)  # the last write wins
    source_of = torch.from_numpy(source_at[_strided_positions(x.shape, layout)]).to(x.device)  # by element
    written = source_of >= 0
    taken = src.reshape(-1).index_select(0, source_of.clamp(min=0)) if src.numel() else \
        torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
    return torch.where(written, taken.to(x.dtype), x.reshape(-1)).reshape(x.shape)


def defined_elsewhere() -> dict:
    """Decompositions of operators that exist once another torch module has defined them, looked up when a graph
    is compiled: prims.fma is torch._inductor's (its lerp decomposition, which torch.compile uses when it traces
    an optimizer step, emits it); importing torch._inductor here would cost every compile seconds."""
    fma = getattr(torch.ops.prims, "fma", None)
    return {fma.default: _fused_multiply_add} if fma is not None else {}


def _foreach_decompositions() -> dict:
    """Every functional overload of ATen's ``_foreach_*`` ops whose per-tensor op exists. Listed from the
    dispatcher's operator names ("aten::_foreach_add.Scalar"; 4 ms), not from every operator's parsed schema
    (15 ms, at the first eager compile of a process): the same operators (tests/test_frontend.py)."""
    table = {}
    for full in torch._C._dispatch_get_all_op_names():
        name, _, overload_name = full.partition(".")
        name = name.removeprefix("aten::")
        if not full.startswith("aten::_foreach_") or name.endswith("_") or overload_name.endswith("out"):
            continue
        base = name.removeprefix("_foreach_")
        if base not in _FOREACH_TARGETS and not hasattr(aten, base):
            continue
        overload = getattr(getattr(aten, name), overload_name or "default")
        table[overload] = _foreach(overload)
    return table


def _shift_by_scalar(shift):
    """A shift by a Python number as the tensor-by-tensor shift (the one torch-mlir lowers), the amount a 0-d
    tensor of x's dtype."""
    def shift_by(x, amount):
        return shift(x, torch.scalar_tensor(amount, dtype=x.dtype, device=x.device))
    return shift_by



CDIST_MM_ROWS = 25  # ATen's cdist_impl: with compute_mode 0, p = 2 uses the matmul form past 25 rows (Distance.cpp)


def _cdist_uses_matmul(x1, x2, p, compute_mode) -> bool:
    mode = 0 if compute_mode is None else compute_mode
    return p == 2 and (mode == 1 or (mode == 0 and max(x1.shape[-2], x2.shape[-2]) > CDIST_MM_ROWS))


def _cdist_forward(x1, x2, p, compute_mode=None):
    """Distances between the rows of x1 [.., P, M] and of x2 [.., R, M], as ATen's cdist_impl computes them (no
    lowering in torch-mlir): for p = 2 past 25 rows (or compute_mode 1) the matmul form
    sqrt(clamp(|a|^2 - 2 a.b + |b|^2, 1e-30)), else from the differences [.., P, R, M]: count of nonzeros (p = 0),
    sum of |d| (1), sqrt of the sum of squares (2), max |d| (inf), (sum |d|^p)^(1/p)."""
    if _cdist_uses_matmul(x1, x2, p, compute_mode):
        return aten._euclidean_dist.default(x1, x2)
    d = (x1[..., :, None, :] - x2[..., None, :, :]).abs()
    if p == 0:
        return (d != 0).to(x1.dtype).sum(-1)
    if p == 1:
        return d.sum(-1)
    if p == 2:
        return (d * d).sum(-1).sqrt()
    if p == math.inf:
        return d.amax(-1) if d.shape[-1] else d.sum(-1)
    return d.pow(p).sum(-1).pow(1.0 / p)


def _cdist_backward(grad, x1, x2, p, distances):
    """x1's gradient of `_cdist_forward` from the differences (ATen's cdist_backward; autograd calls it again with
    x1 and x2 exchanged for x2's): sum over x2's rows of grad * dd/dx1, zero where the distance is zero."""
    d = x1[..., :, None, :] - x2[..., None, :, :]
    g, dist = grad[..., None], distances[..., None]
    zero = torch.zeros((), dtype=x1.dtype, device=x1.device)
    if p == 0:
        return torch.zeros_like(x1)
    if p == 1:
        term = g * d.sign()
    elif p == math.inf:
        term = g * d.sign() * (d.abs() == dist).to(x1.dtype)
    elif p < 2:
        term = torch.where((dist == 0) | ((d == 0) & (p < 1)), zero, d.sign() * d.abs().pow(p - 1) * g / dist.pow(p - 1))
    elif p == 2:
        term = torch.where(dist == 0, zero, g * d / dist)
    else:
        term = torch.where(dist == 0, zero, d * d.abs().pow(p - 2) * g / dist.pow(p - 1))
    return term.sum(-2)

OWN = {
    aten.max_pool2d_with_indices.default: _max_pool2d_with_indices,
    aten.max_pool3d_with_indices.default: _max_pool3d_with_indices,
    aten.avg_pool2d.default: _avg_pool2d,
    aten.avg_pool3d.default: _avg_pool3d,
    aten.logcumsumexp.default: _logcumsumexp,
    aten.slice_scatter.default: _slice_scatter,
    aten.avg_pool2d_backward.default: _avg_pool2d_backward,
    aten.avg_pool3d_backward.default: _avg_pool3d_backward,
    aten.max_pool3d_with_indices_backward.default: _max_pool3d_with_indices_backward,
    aten.remainder.Tensor: _python_remainder,
    aten.remainder.Scalar: _python_remainder,
    aten.fmod.Scalar: _fmod_by_scalar,
    **{overload: _scalar_kept_in_fp32(op) for op, overloads in (
        (torch.mul, (aten.mul.Tensor, aten.mul.Scalar)), (torch.div, (aten.div.Tensor, aten.div.Scalar)))
       for overload in overloads},
    **{op: _computed_in_fp32(op) for op in _ONE_KERNEL_IN_FP32},
    aten._log_softmax.default: _log_softmax,
    aten.pow.Tensor_Scalar: _bf16_power,
    aten.floor_divide.default: _floor_divide,
    aten.floor_divide.Scalar: _floor_divide,
    aten.div.Tensor_mode: _div_rounded,
    aten.div.Scalar_mode: _div_rounded,
    aten.sort.stable: _stable_sort,
    aten._embedding_bag.default: _embedding_bag,
    aten._embedding_bag_forward_only.default: _embedding_bag,
    aten._embedding_bag_backward.default: _embedding_bag_backward,
    aten._embedding_bag_dense_backward.default: _embedding_bag_dense_backward,
    aten._embedding_bag_per_sample_weights_backward.default: _embedding_bag_per_sample_weights_backward,
    aten.convolution_backward.default: _convolution_backward,
    aten.convolution.default: _transposed_convolution,
    aten.empty.memory_format: _empty,
    aten.empty_strided.default: _empty_strided,
    aten.diagonal.default: _diagonal,
    aten.diagonal_copy.default: _diagonal,
    aten.diagonal_backward.default: _diagonal_backward,
    aten.diagonal_scatter.default: _diagonal_scatter,
    aten.unfold.default: _unfold,
    aten.unfold_copy.default: _unfold,
    aten.unfold_backward.default: _unfold_backward,
    aten.cumprod.default: _cumprod,
    aten.addbmm.default: _addbmm,
    aten.erfc.default: _erfc,
    aten.lgamma.default: _lgamma,
    aten.digamma.default: _digamma,
    aten.polygamma.default: _polygamma,
    aten.scatter_reduce.two: _scatter_reduce,
    aten.index_reduce.default: _index_reduce,
    aten.fmax.default: _fmax,
    aten.fmin.default: _fmin,
    aten.max.dim: _reduce_with_index_of_scalar(torch.max),
    aten.min.dim: _reduce_with_index_of_scalar(torch.min),
    aten.amax.default: _bool_extreme(torch.amax),
    aten.amin.default: _bool_extreme(torch.amin),
    aten.cummax.default: _cummax,
    aten.cummin.default: _cummin,
    aten.median.default: _median,
    aten.nanmedian.default: _nanmedian,
    aten.median.dim: _median_dim(ignore_nan=False),
    aten.nanmedian.dim: _median_dim(ignore_nan=True),
    aten.kthvalue.default: _kthvalue,
    aten.mode.default: _mode,
    aten.searchsorted.Tensor: _searchsorted,
    aten.searchsorted.Scalar: _searchsorted,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_attention_for_cpu_backward,
    aten.segment_reduce.default: _segment_reduce,
    aten.special_bessel_j0.default: _bessel_j0,
    aten.special_bessel_j1.default: _bessel_j1,
    aten.special_bessel_y0.default: _bessel_y0,
    aten.special_bessel_y1.default: _bessel_y1,
    aten.special_modified_bessel_i0.default: _modified_bessel_i0,
    aten.special_modified_bessel_i1.default: _modified_bessel_i1,
    aten.special_i1.default: _modified_bessel_i1,  # torch.special.i1: the same function, ATen's calc_i1
    aten.special_i1e.default: _scaled_modified_bessel_i1,
    aten.special_i0e.default: lambda x: _i0_unscaled(x.abs()),  # exp(-|x|) I0(x), ATen's calc_i0e
    aten.special_modified_bessel_k0.default: _modified_bessel_k0,
    aten.special_modified_bessel_k1.default: _modified_bessel_k1,
    aten.special_scaled_modified_bessel_k0.default: _scaled_modified_bessel_k0,
    aten.special_scaled_modified_bessel_k1.default: _scaled_modified_bessel_k1,
    aten.special_spherical_bessel_j0.default: _spherical_bessel_j0,
    # `x << s`, `x >> s` on integer tensors: torch-mlir lowers the bitwise_*_shift ops (StableHLO's shifts), not these
    aten.__lshift__.Tensor: aten.bitwise_left_shift.Tensor,
    aten.__lshift__.Scalar: _shift_by_scalar(aten.bitwise_left_shift.Tensor),
    aten.bitwise_left_shift.Tensor_Scalar: _shift_by_scalar(aten.bitwise_left_shift.Tensor),
    aten.__rshift__.Tensor: aten.bitwise_right_shift.Tensor,
    aten.__rshift__.Scalar: _shift_by_scalar(aten.bitwise_right_shift.Tensor),
    aten.bitwise_right_shift.Tensor_Scalar: _shift_by_scalar(aten.bitwise_right_shift.Tensor),
    aten.linalg_lu_factor_ex.default: _linalg_lu_factor_ex,
    aten.linalg_lu_solve.default: _linalg_lu_solve,
    aten.linalg_solve_triangular.default: _linalg_solve_triangular,
    aten._linalg_det.default: _linalg_det,
    aten._linalg_slogdet.default: _linalg_slogdet,
    aten.linalg_inv_ex.default: _linalg_inv_ex,
    aten._linalg_solve_ex.default: _linalg_solve_ex,
    aten.linalg_lu.default: _linalg_lu,
    aten.lu_unpack.default: _lu_unpack,
    aten._native_multi_head_attention.default: _native_multi_head_attention,
    aten._transformer_encoder_layer_fwd.default: _transformer_encoder_layer,
    aten._cdist_forward.default: _cdist_forward,
    aten._cdist_backward.default: _cdist_backward,

    aten.addmv.default: _addmv,
    aten._scaled_mm.default: _scaled_mm,
    aten.cholesky.default: _cholesky,
    aten.linalg_cholesky_ex.default: _linalg_cholesky_ex,
    aten.clamp.Tensor: _clamp_tensor,
    aten.put.default: _put,
    aten._trilinear.default: _trilinear,
    aten._pdist_forward.default: _pdist_forward,
    aten._pdist_backward.default: _pdist_backward,
    aten._adaptive_avg_pool3d.default: _adaptive_avg_pool3d,
    aten._adaptive_avg_pool3d_backward.default: _adaptive_avg_pool_backward,
    aten.adaptive_max_pool3d.default: adaptive_max_pool,
    aten.adaptive_max_pool3d_backward.default: _adaptive_max_pool3d_backward,
    aten.as_strided_scatter.default: _as_strided_scatter,
    aten.index.Tensor: _empty_index,
    aten.take.default: _take,
    **_foreach_decompositions(),
}
for _kind in "tuvw":
    for _shifted in (False, True):
        _op = getattr(aten, f"special_{'shifted_' if _shifted else ''}chebyshev_polynomial_{_kind}")
        OWN.update(dict.fromkeys((_op.default, _op.n_scalar, _op.x_scalar), _chebyshev_polynomial(_kind, _shifted)))
for _op, _physicists in ((aten.special_hermite_polynomial_h, True), (aten.special_hermite_polynomial_he, False)):
    OWN.update(dict.fromkeys((_op.default, _op.n_scalar, _op.x_scalar), _hermite_polynomial(_physicists)))
for _op, _lowering in ((aten.special_laguerre_polynomial_l, _laguerre_polynomial_l),
                       (aten.special_legendre_polynomial_p, _legendre_polynomial_p)):
    OWN.update(dict.fromkeys((_op.default, _op.n_scalar, _op.x_scalar), _lowering))
for _op in (aten.erfc.default, aten.lgamma.default, aten.digamma.default, aten.polygamma.default,
            aten.special_i1.default, aten.special_i1e.default, aten.special_i0e.default):  # ATen's bf16 kernels: fp32
    OWN[_op] = _in_fp32(OWN[_op])


# Backward-only ops: what training graphs meet that forward graphs do not (found by `benchmarks.opinfo --backward`).

def _segment_members(data, lengths, offsets, axis):
    """(the segment axis, lengths, member): member[..., s, j] says position j of the axis is in segment s."""
    if lengths is None:
        lengths = offsets[..., 1:] - offsets[..., :-1]
    axis = lengths.dim() - 1  # ATen's backward kernel takes the axis from the lengths' rank, whatever it is given
    ends = torch.cumsum(lengths, -1)
    position = torch.arange(data.shape[axis], device=data.device)
    member = ((ends - lengths).unsqueeze(-1) <= position) & (position < ends.unsqueeze(-1))
    return axis, lengths, member


def _segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    """ATen's CPU backward of segment_reduce, position by position as a dense mask of segments x positions:
    sum and mean spread the segment's gradient (mean divided by its length); max and min give it to every
    position equal to the result or NaN and, where two or more are, divide the positive ones (only those: ATen's
    kernel) by their count; prod is grad x result / x, or where x is 0 or NaN grad x the product of the segment's
    other values and `initial`. A position in no segment gets 0."""
    axis, lengths, member = _segment_members(data, lengths, offsets, axis)
    trailing = (1,) * (data.dim() - axis - 1)
    member_at = member.reshape(member.shape + trailing)  # [..., S, N, 1...]

    def per_position(per_segment):  # [..., S, T...] -> [..., N, T...]: each position's segment's value
        return torch.where(member_at, per_segment.unsqueeze(axis + 1), 0).sum(axis)

    covered = member_at.any(axis)
    g = per_position(grad)
    if reduce in ("sum", "mean"):
        if reduce == "mean":
            g = g / per_position(lengths.reshape(lengths.shape + trailing).to(grad.dtype))
        return torch.where(covered, g, 0)
    if reduce in ("max", "min"):
        hit = covered & (torch.isnan(data) | (data == per_position(output)))
        count = per_position(torch.where(member_at, hit.unsqueeze(axis), False).sum(axis + 1))
        g = torch.where(hit, g, 0)
        return torch.where((count >= 2) & (g > 0), g / count, g)
    if reduce == "prod":
        same = (member.unsqueeze(-1) & member.unsqueeze(-2)).any(-3)  # [..., N, N]: j and k share a segment
        n = data.shape[axis]
        others = same & ~torch.eye(n, dtype=torch.bool, device=data.device)
        others = others.reshape(others.shape + trailing)
        excluded = torch.where(others, data.unsqueeze(axis), 1).prod(axis + 1)
        if initial is not None:
            excluded = excluded * initial
        direct = g * per_position(output) / data
        g = torch.where(torch.isnan(data) | (data == 0), g * excluded, direct)
        return torch.where(covered, g, 0)
    return NotImplemented


def _of_scalars(scatter):
    """scatter/scatter_add into a 0-d tensor (the backward of cummax/cummin, max/min over a dim of a 0-d input):
    the same on 1-element vectors (torch-mlir cannot lower the 0-d form); other ranks are left to torch-mlir."""
    def lowering(x, dim, index, src):
        if x.dim() != 0:
            return NotImplemented
        src = src.reshape(1) if isinstance(src, torch.Tensor) else src
        return scatter(x.reshape(1), 0, index.reshape(1), src).reshape(())
    return lowering


def _new_empty_strided(x, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Tensor.new_empty_strided (circular pad's backward of an empty input): unspecified values, zeros here."""
    return _zeros(size, dtype or x.dtype, device or x.device)


def _cot_derivative_polynomial(x, n: int):
    """The n-th derivative of cot(pi x) for any n >= 1, as pi^n P_n(cot(pi x)): d/du cot u = -(1 + cot^2 u), so
    P_0(c) = c and P_k+1(c) = -(1 + c^2) P_k'(c); evaluated by Horner from the highest power."""
    coefficients = np.polynomial.Polynomial([0.0, 1.0])
    for _ in range(n):
        coefficients = -np.polynomial.Polynomial([1.0, 0.0, 1.0]) * coefficients.deriv()
    angle = math.pi * (x - torch.floor(x))
    cot = torch.cos(angle) / torch.sin(angle)
    value = torch.zeros_like(x)
    for c in reversed(coefficients.coef):
        value = value * cot + float(c)
    return math.pi ** n * value


def _cross_entropy_gradient_of_logits(logits, target, weight, reduction, ignore_index):
    """(loss, d loss / d logits) of cross_entropy over class indices (no label smoothing): for each row i not
    ignored, w[t_i] (softmax_i - onehot(t_i)) divided, for 'mean', by the sum of the rows' w[t_i] (as nll_loss)."""
    log_p = torch.log_softmax(logits, 1)
    onehot = target.unsqueeze(1) == torch.arange(logits.shape[1], device=logits.device)
    kept = (target != ignore_index).to(logits.dtype)
    row_weight = kept if weight is None else kept * torch.where(onehot, weight.to(logits.dtype), 0).sum(1)
    loss = -(torch.where(onehot, log_p, 0).sum(1) * row_weight).sum()
    gradient = row_weight.unsqueeze(1) * (torch.exp(log_p) - onehot.to(logits.dtype))
    if reduction == "mean":
        total = row_weight.sum()
        loss, gradient = loss / total, gradient / total
    return loss, gradient


def _linear_cross_entropy_batch_chunked(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                        label_smoothing, batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph,
                                        compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad):
    """torch.nn.functional.linear_cross_entropy's chunked custom op (mean or sum of class indices, no label
    smoothing, 2-d input): the loss and its gradients with respect to the input, weight and bias, which the op
    computes in its forward (its backward scales them by the loss's gradient). In one piece, not in batch chunks:
    the compiler plans the memory; computed in fp32 and returned in the input's dtype as the op's."""
    if reduction not in ("mean", "sum") or label_smoothing != 0.0:
        return NotImplemented
    dtype = input.dtype
    x, w = input.float(), linear_weight.float()
    logits = x @ w.T + (0 if linear_bias is None else linear_bias.float())
    loss, gradient = _cross_entropy_gradient_of_logits(logits, target, weight, reduction, ignore_index)
    grad_input = (gradient @ w).to(dtype) if compute_input_grad else input.new_zeros((0, 0))
    grad_weight = (gradient.T @ x).to(dtype) if compute_linear_weight_grad else input.new_zeros((0, 0))
    grad_bias = gradient.sum(0).to(dtype) if compute_linear_bias_grad else input.new_zeros((0,))
    return loss.to(dtype), grad_input, grad_weight, grad_bias


def _linear_cross_entropy_batch_chunked_no_reduction(input, linear_weight, target, linear_bias, weight, ignore_index,
                                                     batch_chunk_size, acc_policy, acc_dtype):
    """The chunked op of reduction='none' (its forward only gives the losses; its backward recomputes them in
    Python, which AOTAutograd traces): row i's loss -w[t_i] log_softmax(x_i W^T + b)[t_i], 0 where t_i is
    ignore_index, as eager's cross_entropy(reduction='none'); in fp32, returned in the input's dtype."""
    x, w = input.float(), linear_weight.float()
    logits = x @ w.T + (0 if linear_bias is None else linear_bias.float())
    onehot = target.unsqueeze(1) == torch.arange(logits.shape[1], device=logits.device)
    kept = (target != ignore_index).to(logits.dtype)
    row_weight = kept if weight is None else kept * torch.where(onehot, weight.to(logits.dtype), 0).sum(1)
    picked = torch.where(onehot, torch.log_softmax(logits, 1), 0).sum(1)
    return (-picked * row_weight).to(input.dtype)


def defined_after_import() -> dict:
    """Decompositions of custom operators torch registers only when their module is first imported
    (linear_cross_entropy's chunked ops), looked up when a graph is compiled."""
    table = {}
    for name, lowering in (("_linear_cross_entropy_batch_chunked", _linear_cross_entropy_batch_chunked),
                           ("_linear_cross_entropy_batch_chunked_no_reduction",
                            _linear_cross_entropy_batch_chunked_no_reduction)):
        op = getattr(torch.ops.torch_nn, name, None)
        if op is not None:
            table[op.default] = lowering
    return table


def _replication_pad_backward(grad, x, padding):
    """replication_pad{1,2,3}d_backward: output position o of a padded dim (pads lo, hi; negative ones crop) reads
    input position clamp(o - lo, 0, n - 1), so each input position sums the gradient of the positions reading it
    (a dense one-hot of output x input positions per dim; torch-mlir cannot lower these ops)."""
    for k in range(len(padding) // 2):
        dim, low = x.dim() - 1 - k, padding[2 * k]
        n, n_out = x.shape[dim], grad.shape[dim]
        source = torch.clamp(torch.arange(n_out, device=grad.device) - low, 0, n - 1)
        reads = source.unsqueeze(1) == torch.arange(n, device=grad.device)  # [n_out, n]
        moved = grad.movedim(dim, -1).unsqueeze(-1)  # [..., n_out, 1]
        grad = torch.where(reads, moved, 0).sum(-2).movedim(-1, dim)
    return grad


def _backward_decompositions() -> dict:
    return {
        aten._segment_reduce_backward.default: _segment_reduce_backward,
        aten.scatter_add.default: _of_scalars(torch.scatter_add),
        aten.scatter.src: _of_scalars(torch.scatter),
        aten.scatter.value: _of_scalars(torch.scatter),
        aten._adaptive_avg_pool2d_backward.default: functools.partial(_adaptive_avg_pool_backward, spatial=2),
        # adaptive_max_pool2d stays whole in training graphs (forward graphs reach a decomposition torch-mlir lowers)
        aten.adaptive_max_pool2d.default: adaptive_max_pool,
        aten.adaptive_max_pool2d_backward.default: functools.partial(_adaptive_max_pool3d_backward, spatial=2),
        aten.new_empty_strided.default: _new_empty_strided,
        aten.replication_pad1d_backward.default: _replication_pad_backward,
        aten.replication_pad2d_backward.default: _replication_pad_backward,
        aten.replication_pad3d_backward.default: _replication_pad_backward,
        aten.grid_sampler_3d.default: _grid_sampler_nd,
        aten.grid_sampler_3d_backward.default: _grid_sampler_nd_backward,
        aten.grid_sampler_2d_backward.default: _grid_sampler_nd_backward,
    }


def _grid_source_index(coords, size: int, padding_mode: int, align_corners: bool):
    """(source index, d index / d coord) of ATen's grid_sampler_compute_source_index_set_grad: unnormalized from
    [-1, 1], then clipped to the borders (padding 1) or reflected and clipped (padding 2); a clipped coordinate's
    gradient is 0, the borders included (ATen: "borders are considered out of bounds" for the gradient)."""
    if align_corners:
        index, multiplier = (coords + 1) / 2 * (size - 1), (size - 1) / 2
    else:
        index, multiplier = ((coords + 1) * size - 1) / 2, size / 2
    multiplier = torch.full_like(coords, multiplier)
    if padding_mode == 2:
        twice_low, twice_high = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        if twice_low == twice_high:
            index, multiplier = torch.zeros_like(index), torch.zeros_like(multiplier)
        else:
            low, span = twice_low / 2, (twice_high - twice_low) / 2
            shifted = index - low
            multiplier = torch.where(shifted < 0, -multiplier, multiplier)
            shifted = shifted.abs()
            extra = torch.fmod(shifted, span)
            even = torch.remainder(torch.floor(shifted / span), 2) == 0
            index = torch.where(even, extra + low, span - extra + low)
            multiplier = torch.where(even, multiplier, -multiplier)
    if padding_mode in (1, 2):
        inside = (index > 0) & (index < size - 1)
        multiplier = torch.where(inside, multiplier, 0)
        index = torch.clamp(index, 0, size - 1)
    return index, multiplier


def _grid_corners(x, grid, interpolation_mode: int, padding_mode: int, align_corners: bool):
    """The points grid_sampler_{2,3}d reads, as ATen's CPU kernels: per point of the flattened output, the source
    index of each spatial dim (the grid's coordinates are x = W, y = H, z = D) with its gradient multiplier, and
    per corner (2^d for bilinear, 1 for nearest: round half to even as nearbyint) its flat position in the
    flattened input volume (0 where out of bounds), whether it is in bounds, and per spatial dim its linear
    weight factor (1 - t or t) and the sign of that factor's derivative."""
    sizes = x.shape[2:][::-1]  # W, H, (D): the order of the grid's coordinates
    n = grid.shape[0]
    points = grid.reshape(n, -1, len(sizes))
    sources = [_grid_source_index(points[..., k], size, padding_mode, align_corners) for k, size in enumerate(sizes)]
    strides = [math.prod(sizes[:k]) for k in range(len(sizes))]  # W is the fastest-varying dim of the volume
    if interpolation_mode == 1:
        choices = [[(torch.round(index), None, 0)] for index, _ in sources]
    else:
        floors = [torch.floor(index) for index, _ in sources]
        choices = [[(f, (f + 1) - index, -1), (f + 1, index - f, 1)] for f, (index, _) in zip(floors, sources)]
    # per dim and choice, once: in bounds, and the offset in the volume
    choices = [[(at, factor, sign, (at >= 0) & (at < size), at.to(torch.int64) * stride)
                for at, factor, sign in dim_choices] for dim_choices, size, stride in zip(choices, sizes, strides)]
    corners = []
    for corner in itertools.product(*choices):
        inside = functools.reduce(torch.logical_and, [ok for *_, ok, _ in corner])
        position = torch.where(inside, sum(offset for *_, offset in corner), 0)
        corners.append((position, inside, [(factor, sign) for _, factor, sign, _, _ in corner]))
    return sources, corners


def _grid_sampler_nd(x, grid, interpolation_mode, padding_mode, align_corners):
    """grid_sampler_3d (and the 2-d form) forward, bilinear or nearest: each output point the sum over the corners
    in bounds of input x weight (ATen's CPU kernel; out-of-bounds corners add nothing: zeros padding)."""
    if interpolation_mode not in (0, 1) or padding_mode not in (0, 1, 2):
        return NotImplemented
    n, c = x.shape[:2]
    _, corners = _grid_corners(x, grid, interpolation_mode, padding_mode, align_corners)
    volume = x.reshape(n, c, -1)
    out = None
    for position, inside, factors in corners:
        value = torch.gather(volume, 2, position.unsqueeze(1).expand(n, c, -1))
        weight = math.prod(f for f, _ in factors) if interpolation_mode == 0 else None
        term = torch.where(inside.unsqueeze(1), value if weight is None else value * weight.unsqueeze(1), 0)
        out = term if out is None else out + term
    return out.reshape((n, c) + grid.shape[1:-1])


def _grid_sampler_nd_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    """grid_sampler_{2,3}d_backward, bilinear or nearest, as ATen's CPU kernels: the input's gradient is the
    output's gradient x each corner's weight scatter-added at the corners in bounds; the grid's, per coordinate,
    the sum over channels and corners in bounds of input x output gradient x the derivative of the corner's weight
    along that coordinate (the other dims' factors, signed), times the source index's gradient multiplier.
    Nearest has no grid gradient (zeros, as ATen)."""
    if interpolation_mode not in (0, 1) or padding_mode not in (0, 1, 2):
        return NotImplemented
    n, c = x.shape[:2]
    sources, corners = _grid_corners(x, grid, interpolation_mode, padding_mode, align_corners)
    g = grad.reshape(n, c, -1)
    volume = x.reshape(n, c, -1)
    grad_x = torch.zeros_like(volume) if output_mask[0] else None
    per_dim = [None] * len(sources)
    for position, inside, factors in corners:
        where = position.unsqueeze(1).expand(n, c, -1)
        mask = inside.unsqueeze(1)
        if grad_x is not None:
            weight = math.prod(f for f, _ in factors) if interpolation_mode == 0 else None
            spread = g if weight is None else g * weight.unsqueeze(1)
            grad_x = grad_x.scatter_add(2, where, torch.where(mask, spread, 0))
        if interpolation_mode != 0 or not output_mask[1]:
            continue
        value_times_grad = torch.where(mask, torch.gather(volume, 2, where) * g, 0).sum(1)  # [n, points]
        for k in range(len(sources)):
            others = math.prod(f for j, (f, _) in enumerate(factors) if j != k)
            term = value_times_grad * others * factors[k][1]
            per_dim[k] = term if per_dim[k] is None else per_dim[k] + term
    if interpolation_mode == 0 and output_mask[1]:
        grad_grid = torch.stack([d * multiplier for d, (_, multiplier) in zip(per_dim, sources)], -1)
        grad_grid = grad_grid.reshape(grid.shape)
    else:
        grad_grid = torch.zeros_like(grid)
    return (grad_x.reshape(x.shape) if grad_x is not None else None), grad_grid


OWN.update(_backward_decompositions())
