"""neuronc: an ahead-of-time compiler and emulated Trainium NeuronCore for PyTorch.

Importing this package is cheap: torch, torch-mlir and jax are imported only by the modules that
need them, on first use.
"""
__version__ = "0.1.0"


def bisect(fn, *args, **options):
    """Which op of `fn` the NeuronCore computes wrongly, and after which compiler pass: `fn(*args)` runs as
    torch.compile(fn, backend="neuron") would compile it, and every graph it compiles is compared value by
    value with XLA on CPU (neuronc/differential.py). Returns the reports; print them. `options`: target,
    opt_level, auto_cast, auto_cast_type, reference ("xla" or "interpreter")."""
    from neuronc.differential import bisect as run

    return run(fn, *args, **options)
