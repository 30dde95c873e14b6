"""Kernels written in neuronc's NKI-compatible language, as AWS's NKI library ships them: RMSNorm, causal flash
attention (forward and backward), MoE token dispatch and combine. Each is an ``@nki.jit`` kernel; call it with
numpy arrays (the emulated NeuronCore), with torch tensors (``neuron`` or CPU), or wrap it in a
``torch.library.custom_op`` to use it inside ``torch.compile(backend="neuron")`` graphs (see
``neuronc.pytorch.custom_kernels``). ``python -m benchmarks.kernels`` measures each against the compiler's own
fusion of the same op.
"""
from neuronc.nki.library.flash_attention import flash_attention_backward, flash_attention_forward
from neuronc.nki.library.moe import moe_combine, moe_dispatch
from neuronc.nki.library.rmsnorm import rmsnorm

__all__ = ["flash_attention_backward", "flash_attention_forward", "moe_combine", "moe_dispatch", "rmsnorm"]
