"""Read a `.pt2` archive without letting it run code.

`torch.export.load` unpickles a `.pt2`'s weights, constants and sample inputs with `weights_only=False`,
parses shape expressions with `sympy.sympify` (an `eval`), resolves call targets by any attribute path
under `torch`, and loads AOTInductor shared libraries: a crafted archive runs whatever it carries. This
module reads the same archive format (torch 2.13's `torch.export.save`) with none of that:

* the program comes from its JSON (`models/model.json`), vetted before PyTorch's deserializer sees it:
  every call target must be an ATen/prims operator overload, a symbolic-shape helper torch.export itself
  emits, or one of a few higher-order operators; shape expressions (dynamic shapes), custom objects and
  extension operators are refused (neuronc compiles static shapes, and does not evaluate strings);
* tensors are raw bytes read as the declared dtype and strides, or pickled tensors read with
  `torch.load(weights_only=True)`, PyTorch's restricted unpickler that builds tensors and nothing else;
* everything else (AOTInductor code, executorch blobs, pickled Python objects) is never opened.

What cannot be read that way is refused with a `ModelLoadError` naming the archive member.
"""
from __future__ import annotations

import io
import json
import operator
import zipfile

from neuronc.errors import ModelLoadError
from neuronc.host_memory import HOST_BUDGET_VARIABLE, host_memory_budget

MODEL_NAME = "model"  # the program torch.export.save writes and torch.export.load returns
RESAVE = "re-save it with torch.export.save(torch.export.export(model, example_inputs), path) on torch 2.13"

# Higher-order operators whose bodies are subgraphs of the same (vetted) archive.
HIGHER_ORDER_OPS = frozenset({
    "cond", "while_loop", "map_impl", "scan", "associative_scan", "invoke_subgraph", "with_effects",
    "wrap_with_set_grad_enabled", "wrap_with_autocast", "auto_functionalized", "auto_functionalized_v2",
})


class _Archive:
    """The members of a `.pt2` zip, addressed without the folder torch.export.save puts them in."""

    def __init__(self, path: str, zf: zipfile.ZipFile):
        self.path, self.zip = path, zf
        names = zf.namelist()
        roots = {name.split("/", 1)[0] for name in names}
        if len(roots) != 1 or any("/" not in name for name in names):
            raise ModelLoadError(f"{path} is not a saved ExportedProgram (its members are not in one folder, "
                                 "as torch.export.save writes them)", hint=RESAVE)
        self.root = roots.pop() + "/"
        self.names = {name[len(self.root):] for name in names}

    def has(self, member: str) -> bool:
        return member in self.names

    def read(self, member: str) -> bytes:
        size, budget = self.size(member), host_memory_budget()
        if size > budget:
            raise self.error(member, f"expands to {size} bytes, more than the host memory budget of {budget}",
                             hint=f"on a machine with that much memory, raise {HOST_BUDGET_VARIABLE}")
        try:
            return self.zip.read(self.root + member)
        except (KeyError, zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError) as err:
            raise self.error(member, f"cannot be read ({type(err).__name__}: {err})") from None

    def json(self, member: str):
        try:
            return json.loads(self.read(member).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise self.error(member, f"is not valid JSON ({type(err).__name__})") from None

    def size(self, member: str) -> int:
        """The member's length once decompressed, as its zip entry declares it."""
        return self.zip.getinfo(self.root + member).file_size

    def error(self, member: str, problem: str, hint: str = RESAVE) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: archive member {self.root}{member} {problem}", hint=hint)


def read_exported_program(path: str):
    """The ExportedProgram saved in ``path``, read without running an unrestricted unpickler or any
    code or expression from the file."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass
    from torch.export.pt2_archive import constants as names

    with zipfile.ZipFile(path) as zf:
        archive = _Archive(path, zf)
        if archive.has("serialized_exported_program.json"):
            raise archive.error("serialized_exported_program.json", "is of the pre-2.8 format, which neuronc does "
                                "not read")
        for member, expected in ((names.ARCHIVE_FORMAT_PATH, names.ARCHIVE_FORMAT_VALUE),
                                 (names.ARCHIVE_VERSION_PATH, names.ARCHIVE_VERSION_VALUE)):
            if not archive.has(member):
                raise ModelLoadError(f"{path} is not a saved ExportedProgram (it has no member {archive.root}{member}; "
                                     "a file written by torch.save rather than torch.export.save?)", hint=RESAVE)
            found = archive.read(member).decode("utf-8", "replace").strip()
            if found != expected:
                raise archive.error(member, f"says {found!r}; neuronc reads {expected!r}")
        model_member = names.MODELS_FILENAME_FORMAT.format(MODEL_NAME)
        if not archive.has(model_member):
            raise ModelLoadError(f"{path} holds no ExportedProgram (no member {archive.root}{model_member})",
                                 hint=RESAVE)
        document = archive.json(model_member)
        vet_program(document, lambda problem: archive.error(model_member, problem, hint=_hint_for(problem)))
        _plain_containers(document, lambda problem: archive.error(model_member, problem))
        try:
            program = _dict_to_dataclass(schema.ExportedProgram, document)
        except Exception as err:  # noqa: BLE001 - any malformation of the JSON
            raise archive.error(model_member, f"is not a serialized ExportedProgram ({type(err).__name__}: "
                                f"{_first_line(err)})") from None
        state_dict = _read_tensors(archive, names.WEIGHTS_CONFIG_FILENAME_FORMAT.format(MODEL_NAME),
                                   names.WEIGHTS_DIR, f"{names.WEIGHTS_DIR}{MODEL_NAME}.pt")
        constants = _read_tensors(archive, names.CONSTANTS_CONFIG_FILENAME_FORMAT.format(MODEL_NAME),
                                  names.CONSTANTS_DIR, f"{names.CONSTANTS_DIR}{MODEL_NAME}.pt")
        sample_member = names.SAMPLE_INPUTS_FILENAME_FORMAT.format(MODEL_NAME)
        sample_inputs = _load_tensors(archive, sample_member) if archive.has(sample_member) else None
        if sample_inputs is not None and not (isinstance(sample_inputs, tuple) and len(sample_inputs) == 2):
            raise archive.error(sample_member, "does not hold (args, kwargs)")
    try:
        return ExportedProgramDeserializer().deserialize(program, state_dict, constants, sample_inputs)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds for a bad program
        raise ModelLoadError(f"{path}: the program in {archive.root}{model_member} could not be rebuilt "
                             f"({type(err).__name__}: {_first_line(err)})", hint=RESAVE) from None


# -- the program ------------------------------------------------------------------------------------------

def vet_program(document, refuse) -> None:
    """Raise ``refuse(problem)`` unless the serialized program ``document`` (parsed JSON) only calls
    operators and holds no expression to evaluate and no object to rebuild. Strips guards code (Python
    source torch would compile for the unlifted module, which neuronc never builds)."""
    if not isinstance(document, dict) or not isinstance(document.get("graph_module"), dict):
        raise refuse("is not a serialized ExportedProgram")
    if document.get("range_constraints"):
        raise refuse(f"declares dynamic shapes ({', '.join(map(str, document['range_constraints']))})")
    document["guards_code"] = []
    pending = [document["graph_module"]]
    while pending:  # an explicit stack: nesting depth is the file's choice, not a recursion limit
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        if {"target", "inputs", "outputs"} <= item.keys():
            _vet_target(item["target"], refuse)
        for key, value in item.items():
            if value is None:
                continue
            if key == "as_operator":
                _vet_target(value, refuse)
            elif key in ("as_expr", "expr_str"):
                raise refuse("declares dynamic shapes (a symbolic expression)")
            elif key in ("as_custom_obj", "custom_obj"):
                raise refuse("holds a custom object (a TorchScript class or opaque Python object)")
            pending.append(value)


def _plain_containers(document, refuse) -> None:
    """Rewrite the input and output trees (pytree specs) so that every container type this process has not
    registered reads as a plain dict (its context is a list of key names, as a dataclass such as
    transformers' ``ModelOutput`` gives) or tuple. A model's outputs are often such classes; rebuilding them
    would need their library imported, and neuronc only uses the flattened leaves, which are unchanged."""
    from torch.utils._pytree import SERIALIZED_TYPE_TO_PYTHON_TYPE

    for entry in document["graph_module"].get("module_call_graph") or ():
        signature = entry.get("signature") if isinstance(entry, dict) else None
        if not isinstance(signature, dict):
            continue
        for field in ("in_spec", "out_spec"):
            if not isinstance(signature.get(field), str):
                continue
            try:
                protocol, tree = json.loads(signature[field])
            except (ValueError, TypeError, RecursionError):
                raise refuse(f"has a {field} that is not a serialized pytree spec") from None
            pending = [tree]
            while pending:
                node = pending.pop()
                if not isinstance(node, dict):
                    raise refuse(f"has a {field} that is not a serialized pytree spec")
                kind = node.get("type")
                if kind is not None and kind not in SERIALIZED_TYPE_TO_PYTHON_TYPE:
                    keys = _json_or_none(node.get("context"))
                    is_keyed = isinstance(keys, list) and all(isinstance(key, str) for key in keys)
                    node["type"] = "builtins.dict" if is_keyed else "builtins.tuple"
                    node["context"] = node["context"] if is_keyed else "null"
                pending.extend(node.get("children_spec") or ())
            signature[field] = json.dumps([protocol, tree])


def _json_or_none(text):
    try:
        return json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None


def _vet_target(name, refuse) -> None:
    if not isinstance(name, str) or not _allowed_target(name):
        raise refuse(f"calls {name!r}, which is not an operator neuronc accepts from a file")


def _allowed_target(name: str) -> bool:
    import torch

    parts = name.split(".")
    if parts[:2] == ["torch", "ops"]:
        if len(parts) == 4 and parts[2] == "higher_order":
            return parts[3] in HIGHER_ORDER_OPS
        if len(parts) != 5:
            return False
        try:  # look the overload up by name; nothing is called
            overload = getattr(getattr(getattr(torch.ops, parts[2]), parts[3]), parts[4])
        except (AttributeError, RuntimeError):
            return False
        return isinstance(overload, torch._ops.OpOverload)
    return name in _python_targets()


def _python_targets() -> frozenset:
    """The serialized names of the Python functions torch.export puts in graphs: getitem and the
    symbolic-shape operators."""
    from torch._export.serde.serialize import _SYM_OPS

    return frozenset(f"{fn.__module__}.{fn.__name__}" for fn in _SYM_OPS | {operator.getitem})


def _hint_for(problem: str) -> str:
    if "dynamic shapes" in problem:
        return "neuronc compiles static shapes: export without dynamic_shapes, one program per shape"
    return "export the model with ATen operators only (no custom objects or Python calls), then " + RESAVE


# -- tensors ----------------------------------------------------------------------------------------------

def _read_tensors(archive: _Archive, config_member: str, directory: str, legacy_member: str) -> dict:
    """Weights or constants: FQN -> tensor, from the payload config and the raw or pickled records."""
    import torch
    from torch._export.serde import schema
    from torch._export.serde.serialize import _dict_to_dataclass
    from torch.export.pt2_archive import constants as names

    if archive.has(legacy_member):
        state = _load_tensors(archive, legacy_member)
        if not isinstance(state, dict):
            raise archive.error(legacy_member, "does not hold a dict of tensors")
        return state
    if not archive.has(config_member):
        raise archive.error(config_member, "is missing")
    try:
        config = _dict_to_dataclass(schema.PayloadConfig, archive.json(config_member)).config
    except ModelLoadError:
        raise
    except Exception as err:  # noqa: BLE001 - any malformation of the JSON
        raise archive.error(config_member, f"is not a payload config ({type(err).__name__})") from None
    tensors, flat = {}, {}
    for fqn, payload in config.items():
        member = directory + payload.path_name
        if "/" in payload.path_name or not archive.has(member):
            raise archive.error(config_member, f"names {payload.path_name!r} for {fqn!r}, which is not a member "
                                "of the archive")
        if payload.path_name.startswith((names.CUSTOM_OBJ_FILENAME_PREFIX, names.OPAQUE_OBJ_FILENAME_PREFIX)):
            raise archive.error(member, f"holds {fqn!r}, a pickled Python object, which neuronc does not unpickle",
                                hint="keep custom objects out of the exported model")
        if payload.use_pickle:
            tensor = _load_tensors(archive, member)
            if not isinstance(tensor, torch.Tensor):
                raise archive.error(member, f"holds a {type(tensor).__name__} for {fqn!r}, not a tensor")
        else:
            if payload.tensor_meta is None:
                raise archive.error(config_member, f"gives no tensor meta for {fqn!r}")
            if member not in flat:
                flat[member] = _raw_storage(archive, member, payload.tensor_meta)
            tensor = _strided(archive, member, flat[member], payload.tensor_meta)
            if payload.is_param:
                tensor = torch.nn.Parameter(tensor, requires_grad=payload.tensor_meta.requires_grad)
        tensors[fqn] = tensor
    return tensors


def _raw_storage(archive: _Archive, member: str, meta):
    """The record's bytes as a flat tensor of the declared dtype (the storage the tensors view)."""
    import torch
    from torch._export.serde.serialize import deserialize_scalar_type

    try:
        dtype = deserialize_scalar_type(meta.dtype)
    except (KeyError, TypeError):
        raise archive.error(member, f"has an unknown dtype code {meta.dtype!r}") from None
    nbytes = archive.size(member)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise archive.error(member, f"holds {nbytes} bytes, not a whole number of {dtype} elements")
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(archive.read(member)), dtype=dtype)


def _strided(archive: _Archive, member: str, storage, meta):
    """The tensor ``meta`` declares over ``storage``: a view, so repeated elements (stride 0) stay shared."""
    import torch
    from torch._export.serde.serialize import deserialize_size, deserialize_storage_offset, deserialize_stride

    try:
        size, stride = deserialize_size(meta.sizes), deserialize_stride(meta.strides)
        offset = deserialize_storage_offset(meta.storage_offset)
    except AssertionError:
        raise archive.error(member, "has a symbolic size or stride; neuronc compiles static shapes") from None
    if len(size) != len(stride) or any(s < 0 for s in size) or any(s < 0 for s in stride) or offset < 0:
        raise archive.error(member, f"declares an impossible layout (size {list(size)}, stride {list(stride)}, "
                            f"offset {offset})")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else -1
    if last >= storage.numel():
        raise archive.error(member, f"holds {storage.numel()} elements, but its tensor of size {list(size)} and "
                            f"stride {list(stride)} reads element {last}")
    return torch.as_strided(storage, size, stride, offset)


def _load_tensors(archive: _Archive, member: str):
    """A pickled tensor (or tuple/dict of tensors) read with PyTorch's restricted unpickler."""
    import torch

    try:
        return torch.load(io.BytesIO(archive.read(member)), weights_only=True, map_location="cpu")
    except ModelLoadError:
        raise
    except Exception as err:  # noqa: BLE001 - UnpicklingError and every malformation
        refused = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), _first_line(err))
        raise archive.error(member, "needs an unrestricted unpickler (it holds something other than tensors), "
                            f"which neuronc never runs on a user's file ({refused})",
                            hint="save plain tensors only; " + RESAVE) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__
