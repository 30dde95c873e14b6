"""StableHLO programs that do not come from PyTorch: MLIR text (`.mlir`), MLIR bytecode or a StableHLO
portable artifact (`.mlirbc`), and serialized `jax.export` artifacts (what `jax.export.export(...)
.serialize()` writes), imported into the graph IR by the same importer as torch-mlir's output.

JAX speaks StableHLO already, so a JAX program needs no converter of its own: its module is parsed with
torch-mlir's MLIR bindings, its private functions and composites (other than those the importer computes
as one op, erf) inlined, simplified as torch-mlir's output is, and imported. Every function argument is a
program input (JAX passes parameters as arguments), named after its MLIR location (`params['w1']`).
Parsing runs in a forked child (`isolate.py`), as torch-mlir's import does: a hostile or damaged file can
crash the MLIR parser, not the user's process. Nothing read from the file is executed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
import zipfile

from neuronc.errors import ModelLoadError, NeuronCompileError
from neuronc.frontend.isolate import run_isolated

SUFFIXES = (".mlir", ".mlirbc")
_BYTECODE_MAGIC = b"ML\xefR"  # MLIR bytecode, and so StableHLO portable artifacts
_PREPARE = ("builtin.module(func.func(stablehlo-legalize-composite-to-call{except=chlo.erf}), inline, symbol-dce, "
            "func.func(stablehlo-aggressive-simplification), canonicalize)")
_ARG_NAME = re.compile(r'^loc\("([^"]+)"\)$')


@dataclasses.dataclass
class StableHLOProgram:
    """A StableHLO module as it was read, before parsing."""

    module: bytes  # MLIR text (UTF-8), MLIR bytecode or a portable artifact
    origin: str  # where it came from, for messages (a path, or "jax.export of f")
    kept_inputs: tuple | None = None  # jax.export: positions of the inputs the module takes (JAX drops unused ones)


def is_stablehlo_file(path) -> bool:
    """Whether `neuronc compile` should read `path` as StableHLO or a jax.export artifact (else as a `.pt2`)."""
    path = os.fspath(path)
    if path.endswith(SUFFIXES):
        return True
    if path.endswith(".pt2") or not os.path.isfile(path) or zipfile.is_zipfile(path):
        return False
    return True


def read_program(path) -> StableHLOProgram:
    """Read a `.mlir`/`.mlirbc` file or a serialized jax.export artifact, with errors a user can act on."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"no such file: {path}", hint="check the path")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path} is a directory, not a program")
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(_BYTECODE_MAGIC) or path.endswith(SUFFIXES):
        return StableHLOProgram(data, path)
    if _looks_like_text(data):
        return StableHLOProgram(data, path)
    return _from_jax_export(data, path)


def _looks_like_text(data: bytes) -> bool:
    try:
        text = data[:4096].decode("utf-8")
    except UnicodeDecodeError:
        return False
    return "module" in text or "func.func" in text


def _from_jax_export(data: bytes, path: str) -> StableHLOProgram:
    """The StableHLO of a serialized jax.export artifact (a flatbuffer; its module a portable artifact)."""
    from jax import export

    try:
        exported = export.deserialize(bytearray(data))
        bytes(exported.mlir_module_serialized)  # a damaged artifact fails here, not later
    except Exception as err:  # noqa: BLE001 - a damaged flatbuffer raises many kinds
        raise ModelLoadError(
            f"{path} is neither StableHLO (.mlir text, .mlirbc bytecode), a jax.export artifact nor a .pt2 "
            f"program ({type(err).__name__} reading it as a jax.export artifact)",
            hint="write one with jax.export.export(jax.jit(f))(*args).serialize(), or "
            "jax.jit(f).lower(*args).as_text() into a .mlir file; a PyTorch program with torch.export.save "
            "into a .pt2 file",
        ) from None
    return exported_program(exported, path)


def exported_program(exported, origin: str) -> StableHLOProgram:
    """A jax.export.Exported as a program neuronc can compile, or the reason it cannot be."""
    if len(exported.platforms) != 1:  # several platforms: the module takes the platform's index first
        raise NeuronCompileError(
            f"{origin} was exported for several platforms ({', '.join(exported.platforms)})",
            hint="export it for one: jax.export.export(jax.jit(f), platforms=['cpu'])")
    if exported.nr_devices != 1:
        raise NeuronCompileError(f"{origin} is sharded over {exported.nr_devices} devices; neuronc compiles "
                                 "programs for one NeuronCore", hint="export the function without sharding")
    if exported.ordered_effects or exported.unordered_effects:
        raise NeuronCompileError(f"{origin} has side effects ({exported.ordered_effects + exported.unordered_effects})",
                                 hint="neuronc compiles pure array programs: remove prints and callbacks")
    symbolic = [f"input {i}: {aval.str_short()}" for i, aval in enumerate(exported.in_avals)
                if not all(isinstance(d, int) for d in aval.shape)]
    if symbolic:
        raise NeuronCompileError(
            f"{origin} has symbolic (shape-polymorphic) input shapes; neuronc compiles one program per shape",
            problems=symbolic, hint="export it with concrete shapes; pad or bucket inputs to a few of them")
    return StableHLOProgram(bytes(exported.mlir_module_serialized), origin, tuple(exported.module_kept_var_idx))


def parse(program: StableHLOProgram):
    """The program's module, parsed in a new MLIR context and prepared for the importer (call in a child)."""
    from torch_mlir import ir as mlir, passmanager
    from torch_mlir._mlir_libs import _stablehlo
    from torch_mlir.dialects import torch as torch_d

    _stablehlo.register_stablehlo_passes()
    context = mlir.Context()
    _stablehlo.register_dialect(context)
    torch_d.register_dialect(context)  # registers the passes torch-mlir adds (stablehlo-aggressive-simplification)
    context.allow_unregistered_dialects = True  # Shardy's (sdy) sharding annotations: meaningless on one core
    try:
        if program.module.startswith(_BYTECODE_MAGIC):
            try:
                module = _stablehlo.deserialize_portable_artifact(context, program.module)
            except Exception:  # noqa: BLE001 - not a portable artifact: plain MLIR bytecode
                module = mlir.Module.parse(program.module, context)
        else:
            module = mlir.Module.parse(program.module.decode("utf-8", errors="replace"), context)
    except Exception as err:  # noqa: BLE001 - the MLIR parser's diagnostics say what is wrong
        detail = str(err).strip().splitlines()
        shardy = "dialect 'sdy'" in str(err)  # JAX's Shardy annotations (every typed PRNG key has one)
        raise ModelLoadError(f"{program.origin} is not a valid StableHLO module: "
                             f"{' '.join(line.strip() for line in detail[:4])[:600]}",
                             hint="export it with jax.config.update('jax_use_shardy_partitioner', False): neuronc "
                             "reads XLA's sharding annotations, not Shardy's" if shardy else
                             "check that the file is complete; write it from jax with "
                             "jax.jit(f).lower(*args).as_text()") from None
    with context:
        passmanager.PassManager.parse(_PREPARE).run(module.operation)
    return module


def signature(module) -> list:
    """(name, "input") for each argument of func @main; refuses dynamic shapes and non-tensor arguments."""
    from torch_mlir import ir as mlir

    from neuronc.frontend.stablehlo_import import main_function

    block = main_function(module).regions[0].blocks[0]
    params, problems = [], []
    for index, arg in enumerate(block.arguments):
        match = _ARG_NAME.match(str(arg.location))
        name = match.group(1) if match else f"arg{index}"
        params.append((name, "input"))
        try:
            static = mlir.RankedTensorType(arg.type).has_static_shape
        except ValueError:  # not a ranked tensor: a token, a tuple, an unranked tensor
            problems.append(f"{name}: {arg.type} is not a tensor of known rank")
            continue
        if not static:
            problems.append(f"{name}: {arg.type} has a dynamic shape")
    if problems:
        raise NeuronCompileError(
            "neuronc compiles programs of static shapes and tensor arguments; this one has others",
            problems=problems, hint="export the program with concrete shapes (pad or bucket inputs to a few)")
    return params


def import_program(program: StableHLOProgram, name: str = "main"):
    """The program as an ImportedGraph (torch_import.ImportedGraph), every argument an input."""
    imported = run_isolated(_import_in_child, program, name, what="the StableHLO import")
    imported.graph.renumbered()
    return imported


def program_text(program: StableHLOProgram) -> str:
    """The prepared module as text (for `neuronc hlo`)."""
    return run_isolated(_text_in_child, program, what="the StableHLO import")


def _text_in_child(program) -> str:
    return parse(program).operation.get_asm(large_elements_limit=16)


def _import_in_child(program, name):
    from neuronc.frontend.stablehlo_import import convert_module, unsupported_error
    from neuronc.frontend.torch_import import ImportedGraph

    start = time.perf_counter()
    module = parse(program)
    seconds = {"import/parse": time.perf_counter() - start}
    graph, problems = convert_module(module, signature(module), None, name, semantics="stablehlo")
    _name_text_lines([*graph.nodes(), *problems], program.origin)
    if problems:
        raise unsupported_error(problems)
    seconds["import/stablehlo->ir"] = time.perf_counter() - start - seconds["import/parse"]
    complete = module.operation.get_asm(enable_debug_info=True).encode()
    return ImportedGraph(graph, module.operation.get_asm(large_elements_limit=16), hashlib.sha256(complete).hexdigest(),
                         seconds)


def survey(program: StableHLOProgram) -> tuple:
    """(uses, graph, problems) for `neuronc check`: how often each op is used, the imported graph (zero
    constants standing in for what cannot be imported) and the ops that cannot be (UnsupportedUse)."""
    graph, uses, problems = run_isolated(_survey_in_child, program, what="the StableHLO import")
    return uses, graph.renumbered(), problems


def _survey_in_child(program):
    import collections

    from neuronc.frontend.stablehlo_import import convert_module, main_function

    module = parse(program)
    block = main_function(module).regions[0].blocks[0]
    uses = collections.Counter(op.operation.name for op in block.operations if op.operation.name != "func.return")
    graph, problems = convert_module(module, signature(module), None, "check", semantics="stablehlo")
    _name_text_lines([*graph.nodes(), *problems], program.origin)
    return graph, uses, problems


def _name_text_lines(located: list, origin: str) -> None:
    """In place: a module without source locations has the lines of its own text as locations, which the
    MLIR parser attributes to "-"; they are lines of the file the program was read from."""
    for item in located:
        if item.loc.file == "-":
            item.loc.file = origin
