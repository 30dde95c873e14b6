"""neuronc: an ahead-of-time compiler and emulated Trainium NeuronCore for PyTorch.

Importing this package is cheap: torch, torch-mlir and jax are imported only by the modules that
need them, on first use.
"""
__version__ = "0.1.0"
