"""Reference executors of StableHLO: what `neuronc bisect` holds the NEFF's values to.

* "xla": XLA's CPU backend through jaxlib, the executor behind `jax.jit` on CPU. The module text is
  compiled as it is and run on numpy inputs. 64-bit integers (torch-mlir's indices) need JAX's x64 mode for
  the inputs to keep their type: it is switched on only around creating them (`jax.enable_x64`, scoped to
  the calling thread), never for the user's process.
* "interpreter": the StableHLO reference interpreter of the stablehlo project, from torch-mlir's bindings:
  slow (an interpreter of each element), but independent of XLA's rewrites; for small graphs. It runs in a
  forked child, like every use of torch-mlir's C++.
"""
from __future__ import annotations

import re

import numpy as np

from neuronc.errors import NeuronConfigError

EXECUTORS = ("xla", "interpreter")


def run_reference(module_text: str, inputs: list, executor: str = "xla") -> list:
    """The results of func @main of a StableHLO module (text) on `inputs` (numpy arrays), as numpy arrays."""
    if executor == "xla":
        return run_xla(module_text, inputs)
    if executor == "interpreter":
        return run_interpreter(module_text, inputs)
    raise NeuronConfigError(f"unknown reference executor {executor!r}", hint=f"use one of {', '.join(EXECUTORS)}")


def run_xla(module_text: str, inputs: list) -> list:
    import jax
    from jax._src.lib import xla_client
    from jax.extend.backend import get_backend

    backend = get_backend("cpu")
    device = backend.local_devices()[0]
    executable = backend.compile_and_load(module_text, xla_client.DeviceList((device,)), xla_client.CompileOptions())
    with jax.enable_x64(True):
        arguments = [jax.device_put(np.asarray(x), device) for x in inputs]
        return [np.asarray(result) for result in executable.execute(arguments)]


def run_interpreter(module_text: str, inputs: list) -> list:
    from neuronc.frontend.isolate import run_isolated

    return run_isolated(_interpret, module_text, [np.asarray(x) for x in inputs], what="the StableHLO interpreter")


def _interpret(module_text: str, inputs: list) -> list:
    from torch_mlir import ir as mlir
    from torch_mlir._mlir_libs import _stablehlo

    context = mlir.Context()
    _stablehlo.register_dialect(context)
    module = mlir.Module.parse(module_text, context)
    with context, mlir.Location.unknown():
        _tensor_constants_as_stablehlo(module)
        arguments = [_attribute(x) for x in inputs]
        return [_array(result) for result in _stablehlo.eval_module(module, arguments)]


def _tensor_constants_as_stablehlo(module) -> None:
    """In place: each `arith.constant` of a tensor (torch-mlir leaves a few, e.g. `dense<1> : tensor<1xi64>`)
    becomes the `stablehlo.constant` of the same value, which means the same: the interpreter runs only the
    StableHLO dialect, and aborts the process on any other op."""
    from torch_mlir import ir as mlir

    constants = []

    def collect(op):
        if op.name == "arith.constant" and isinstance(op.results[0].type, mlir.RankedTensorType):
            constants.append(op)
        return mlir.WalkResult.ADVANCE

    module.operation.walk(collect)
    for op in constants:
        with mlir.InsertionPoint(op), op.location:
            same = mlir.Operation.create("stablehlo.constant", results=[op.results[0].type],
                                         attributes={"value": op.attributes["value"]})
        op.results[0].replace_all_uses_with(same.results[0])
        op.erase()


def _attribute(array: np.ndarray):
    """A numpy array as a dense elements attribute of its MLIR type (bf16 from its bits)."""
    from torch_mlir import ir as mlir

    array = np.require(array, requirements="C")  # not ascontiguousarray: it makes a 0-d array 1-d
    if array.dtype.name != "bfloat16":
        return mlir.DenseElementsAttr.get(array)
    kind = mlir.RankedTensorType.get(list(array.shape), mlir.BF16Type.get())
    return mlir.DenseElementsAttr.get(array.view(np.uint16), type=kind)


def _array(attribute) -> np.ndarray:
    import ml_dtypes
    from torch_mlir import ir as mlir

    kind = mlir.RankedTensorType(attribute.type)
    shape = tuple(kind.shape)
    if str(kind.element_type) == "bf16":  # the bindings give no bf16 buffer: the printed values, exact in fp32
        text = str(attribute)
        body = text[text.index("dense<") + len("dense<"):text.rindex("> :")]
        if body.startswith('"0x'):  # a large attribute prints as its raw bytes (little-endian), not value by value
            bits = np.frombuffer(bytes.fromhex(body[3:-1]), np.dtype("<u2")).view(ml_dtypes.bfloat16)
            return np.broadcast_to(bits, shape).copy() if bits.size == 1 else bits.reshape(shape).copy()
        values = [np.uint16(int(v, 16)).view(ml_dtypes.bfloat16) if v.startswith("0x") else ml_dtypes.bfloat16(float(v))
                  for v in re.findall(r"0x[0-9A-Fa-f]+|[-+]?(?:inf|nan|[0-9.]+(?:[eE][-+]?[0-9]+)?)", body)]
        return np.broadcast_to(np.array(values, ml_dtypes.bfloat16), shape).copy() if len(values) == 1 else \
            np.array(values, ml_dtypes.bfloat16).reshape(shape)
    values = np.array(mlir.DenseElementsAttr(attribute), copy=True)
    return np.broadcast_to(values.reshape(-1)[:1], shape).copy() if values.size != int(np.prod(shape)) else values.reshape(shape)
