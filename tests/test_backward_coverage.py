"""Gradients of ops whose backward graphs hold ATen ops the forward graphs do not (ATen's *_backward ops and the
edge cases of their formulas), compiled strictly on the device with neuronc's own lowerings
(frontend/decompositions.py) and compared with eager autograd on CPU: found by `benchmarks.opinfo --backward`
(issue 21)."""
from __future__ import annotations

import pytest
import torch

from neuronc.tolerances import TOLERANCES

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")


def _gradients(fn, *inputs):
    """fn's outputs and the gradients of its float inputs (each output weighted by fixed random numbers, both signs)."""
    inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator().manual_seed(1)
    floats = [o for o in outputs if o.is_floating_point() and o.requires_grad]
    loss = sum((o * torch.randn(o.shape, generator=generator)).sum() for o in floats)
    grads = torch.autograd.grad(loss, [t for t in inputs if t.requires_grad])
    return [o.detach() for o in outputs], list(grads)


def _matches_eager_gradients(fn, *inputs):
    """Outputs and gradients compiled (fullgraph, fallback off) within fp32's tolerance of eager's, NaN where eager's."""
    torch._dynamo.reset()
    got_outputs, got = _gradients(torch.compile(fn, backend="neuron", fullgraph=True), *inputs)
    want_outputs, want = _gradients(fn, *inputs)
    for g, w in zip(got_outputs + got, want_outputs + want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{g.dtype}{list(g.shape)} != eager {w.dtype}{list(w.shape)}"
        torch.testing.assert_close(g, w, equal_nan=True, **TOLERANCES[w.dtype])


@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "max", "min"])
@pytest.mark.parametrize("initial", [None, 0.5])
def test_segment_reduce_gradient_over_lengths_and_offsets(reduce, initial):
    data = torch.randn(7, 3, generator=torch.Generator().manual_seed(3))
    data[1, 0] = data[0, 0] = data[0, 0].abs() + 3  # a tie at the segment's max: shared by the positive gradients
    data[5, 0] = data[6, 0] = -4.0  # and at the last segment's min
    data[2, 1] = 0.0  # prod: the gradient of a zero is the product of the others
    data[3, 2] = float("nan")
    lengths = torch.tensor([2, 0, 3, 2])  # segment 1 is empty
    offsets = torch.cat([torch.zeros(1, dtype=lengths.dtype), lengths.cumsum(0)])
    _matches_eager_gradients(lambda d, n, o: (torch.segment_reduce(d, reduce, lengths=n, initial=initial),
                                              torch.segment_reduce(d, reduce, offsets=o, initial=initial)),
                             data, lengths, offsets)  # one graph, both forms: one compile per case (the data's gradient is the sum of both forms')


def test_cummax_gradient_of_a_scalar():
    """cummax's backward scatter-adds into the input's shape: a 0-d scatter_add (OpInfo's sample)."""
    _matches_eager_gradients(lambda t: torch.cummax(t, 0)[0] * 3, torch.tensor(1.5))
    _matches_eager_gradients(lambda t: torch.cummin(t, 0)[0] * 3, torch.tensor(-0.5))


def test_max_over_a_dim_of_a_scalar_gradient():
    """max/min over dim 0 of a 0-d tensor (OpInfo's sample): their backward scatters into the input's shape, a 0-d
    scatter.src; a scatter of a value into a 0-d tensor, forward and backward (scatter.value)."""
    _matches_eager_gradients(lambda t: (torch.max(t, 0)[0] * 3, torch.min(t, 0, keepdim=True)[0] - t,
                                        torch.scatter(t, 0, torch.tensor(0), 2.0) + t), torch.tensor(1.5))


def test_circular_pad_gradient_of_an_empty_batch():
    """The backward of a circular pad of no rows builds its gradient in new_empty_strided (OpInfo's sample)."""
    _matches_eager_gradients(lambda t: torch.nn.functional.pad(t, (1, 2), "circular"), torch.randn(0, 3, 3))


@pytest.mark.parametrize("order", [3, 4])
def test_polygamma_gradient_is_the_next_order(order):
    """polygamma(n)'s gradient is polygamma(n + 1): order 4 and 5, over both signs and near the poles."""
    x = torch.cat([torch.linspace(-4.9, 6, 23), torch.tensor([0.3, -0.7, 1e-2, 12.5, 30.0])])
    _matches_eager_gradients(lambda t: torch.polygamma(order, t), x)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias, class_weights", [(False, False), (True, True)])
def test_chunked_linear_cross_entropy_gradients(reduction, bias, class_weights):
    """linear_cross_entropy with options is a custom op computing its gradients in its forward; a target equal
    to ignore_index contributes nothing (and is left out of the mean's weights)."""
    generator = torch.Generator().manual_seed(5)
    x, w = torch.randn(8, 3, generator=generator), torch.randn(4, 3, generator=generator)
    b = torch.randn(4, generator=generator) if bias else None
    weight = torch.rand(4, generator=generator) + 0.5 if class_weights else None
    target = torch.tensor([3, 0, 1, -100, 3, 3, 2, 1])
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2, allow_retain_graph=True)

    def loss(x, w, *b):
        return torch.nn.functional.linear_cross_entropy(x, w, target, linear_bias=b[0] if b else None, weight=weight,
                                                       reduction=reduction, options=options)
    _matches_eager_gradients(loss, x, w, *([b] if bias else []))


@pytest.mark.parametrize("shape, padding", [
    ((2, 5), (2, 3)), ((1, 2, 4, 5), (1, 2, 3, 0)), ((1, 2, 4, 5), (-1, 2, 3, -2)), ((1, 1, 3, 4, 2), (1, 1, 2, 0, 1, 3))])
def test_replicate_pad_gradient_sums_onto_the_edges(shape, padding):
    """Each edge value's gradient sums the padded positions that copy it; negative pads crop (no gradient there)."""
    _matches_eager_gradients(lambda t: torch.nn.functional.pad(t, padding, "replicate"),
                             torch.randn(shape, generator=torch.Generator().manual_seed(6)))


def _grid_points(generator, *shape):
    """Grid coordinates inside and outside [-1, 1], some exactly on a border or a pixel (where the corners and the
    borders' zero gradient are decided)."""
    grid = torch.rand(*shape, generator=generator) * 3 - 1.5
    exact = torch.tensor([-1.0, 1.0, 0.0, 0.5, -0.5, 1.5, 1 / 3])
    grid.view(-1)[::5] = exact[torch.randint(0, len(exact), grid.view(-1)[::5].shape, generator=generator)]
    return grid


def test_grid_sample_3d_gradients_each_padding_and_mode():
    """grid_sampler_3d (forward and backward, no torch-mlir lowering of either) in one graph: trilinear with zeros
    padding and with reflection, each corner convention once, and nearest with border padding (no grid gradient)."""
    generator = torch.Generator().manual_seed(7)
    image, grid = torch.randn(2, 2, 3, 4, 5, generator=generator), _grid_points(generator, 2, 3, 2, 4, 3)

    def samples(x, g):
        sample = torch.nn.functional.grid_sample
        return (sample(x, g, padding_mode="zeros", align_corners=False),
                sample(x, g, padding_mode="reflection", align_corners=True),
                sample(x, g, mode="nearest", padding_mode="border", align_corners=False))
    _matches_eager_gradients(samples, image, grid)


def test_grid_sample_2d_gradients_with_and_without_the_image():
    """grid_sampler_2d_backward (the forward is torch's decomposition): of a constant image only the grid's gradient
    is asked for (output_mask [False, True]), of an input both."""
    generator = torch.Generator().manual_seed(8)
    image, grid = torch.randn(2, 3, 4, 6, generator=generator), _grid_points(generator, 2, 5, 3, 2)
    constant = image * 2
    sample = torch.nn.functional.grid_sample
    _matches_eager_gradients(lambda x, g: (sample(constant, g, padding_mode="reflection", align_corners=False),
                                           sample(x, g, padding_mode="border", align_corners=True)), image, grid)


def test_adaptive_avg_pool2d_gradient_with_a_dim_kept():
    """adaptive_avg_pool2d with an output size of None in one dim (that dim kept: OpInfo's sample) keeps
    `_adaptive_avg_pool2d_backward` in the backward graph (windows overlap: 6 -> 5, 8 -> 5), with and without a
    batch dim."""
    generator = torch.Generator().manual_seed(9)
    pool = torch.nn.functional.adaptive_avg_pool2d
    _matches_eager_gradients(lambda x, y: (pool(x, (None, 5)), pool(y, (5, None))),
                             torch.randn(2, 3, 8, 6, generator=generator), torch.randn(3, 8, 5, generator=generator))


def test_cumprod_gradient_with_and_without_zeros():
    """cumprod's backward finds each column's first zero with max over a dim of a bool mask: a column without a
    zero (all False: eager's index 0; the compiled bool reduction gave index n, out of bounds), with one and two."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10))
    x[1, 1] = x[2, 2] = x[4, 2] = 0.0
    _matches_eager_gradients(lambda t: torch.cumprod(t, 0), x)


def test_bool_extremes_over_a_dim():
    """max/min over a dim and amax/amin of bool tensors (columns all False, all True and mixed): values and first
    indices as eager's."""
    mask = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 1], [0, 1, 0, 1]], dtype=torch.bool)

    def extremes(m):
        return (*torch.max(m, 0, True), *torch.min(m, 1), torch.amax(m, 0), torch.amin(m, 0))
    torch._dynamo.reset()
    got = torch.compile(extremes, backend="neuron", fullgraph=True)(mask)
    for g, w in zip(got, extremes(mask), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{g} != eager {w}"


def test_adaptive_max_pool1d_and_2d_gradients():
    """adaptive_max_pool{1,2}d in a training graph keep aten.adaptive_max_pool2d and its backward (torch-mlir lowers
    neither): overlapping windows (a shared maximum gets both gradients), a tie (the first gets it)."""
    generator = torch.Generator().manual_seed(11)
    x, y = torch.randn(2, 3, 7, 5, generator=generator), torch.randn(3, 8, generator=generator)
    x[0, 0, 2, :] = 4.0  # a row of equal maxima
    _matches_eager_gradients(lambda a, b: (torch.nn.functional.adaptive_max_pool2d(a, (4, 3)),
                                           torch.nn.functional.adaptive_max_pool1d(b, 5)), x, y)
