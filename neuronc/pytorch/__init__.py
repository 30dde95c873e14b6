"""PyTorch integration: the `torch.compile` backend (and, later, the `neuron` device).

The only layer that imports both the compiler and the runtime.
"""
