"""AMP's loss-scaling ops (``torch.amp.GradScaler``) on `neuron` tensors, made of the device's own ops.

``GradScaler.unscale_`` calls ``_amp_foreach_non_finite_check_and_unscale_`` and ``GradScaler.update`` calls
``_amp_update_scale_``. Without kernels of their own they ran on the CPU, every gradient copied to the host and
back at every step. Here each is a few ops on the device (each one a cached program like any eager op), with
the semantics of ATen's CPU kernels: a gradient is checked for inf/NaN before it is unscaled, and the scale grows
only after ``growth_interval`` steps without one, and only to a finite value.
"""
from __future__ import annotations

import torch


def non_finite_check_and_unscale(grads, found_inf, inv_scale) -> None:
    """Each gradient multiplied by ``inv_scale`` in place; ``found_inf`` set to 1 if any held an inf or NaN."""
    for grad in grads:
        found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(grad)).any().to(found_inf.dtype).reshape(found_inf.shape)))
        grad.mul_(inv_scale)


def update_scale(scale, growth_tracker, found_inf, growth_factor: float, backoff_factor: float,
                 growth_interval: int):
    """The next loss scale, in place: backed off after an overflow, grown after ``growth_interval`` clean steps."""
    overflowed = found_inf > 0
    successful = growth_tracker + 1
    grown = scale * growth_factor
    grow = ~overflowed & (successful == growth_interval) & torch.isfinite(grown)
    restart = overflowed | (successful == growth_interval)
    scale.copy_(torch.where(overflowed, scale * backoff_factor, torch.where(grow, grown, scale)))
    growth_tracker.copy_(torch.where(restart, torch.zeros_like(growth_tracker), successful))
    return scale


KERNELS = {
    "_amp_foreach_non_finite_check_and_unscale_": non_finite_check_and_unscale,
    "_amp_update_scale_": update_scale,
}
