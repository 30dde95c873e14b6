"""The graph IR as text: every node with its type, attributes, plans and source location, and back.

`to_text(graph)` prints a graph; `parse(text)` reads it back into a new graph, so that
`to_text(parse(to_text(g))) == to_text(g)`. Pass tests are written in it (IR text in, IR text out), and the debug
folder's `optimized_ir.txt` is it. One node a line (long attribute blocks wrap):

    graph @main(%0, %1) {
      %0 = parameter() : 8x32xf32 {index = 0, name = "x", kind = "input"}
      %1 = constant() : 32xf32 {value = array<32xf32>0x0000803f...}
      %2 = broadcast_in_dim(%1) : 8x32xf32 {dims = (1,)}  loc("model.py", 12, "fc1", "aten.add")
      %3 = add(%0, %2) : 8x32xf32
      return %3
    }

Types are `<dims>x<dtype>` (`f32` alone for a scalar). Attribute values: `none`, `true`, `false`, integers, floats
(`1.5`, `-inf`, `nan`), strings (JSON), tuples `(a, b)`, lists `[a, b]`, dicts `{key = value}`, enum members
(`DType.BF16`, `Op.ADD`, `Engine.VECTOR`), numpy arrays `array<2x3xf32>[1.0, ...]` (or, past 16 elements, their
little-endian bytes in hex: `array<64xf32>0x...`), numpy scalars `scalar<f32>(0.5)`, nodes `%3`, the steps of a
fused body `add(in0, s1) : f32 {...}` (an argument `inI` is the kernel's input I, `sJ` step J's result, anything
else an immediate), and plans `MatmulTiling(resident="a", ...)`: any frozen dataclass of `neuronc.plans` (or one
passed to `register`), printed field by field. `//` starts a comment. Parsing builds only those types: nothing
read executes code.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import math
import re

import numpy as np

from neuronc.errors import NeuronCompileError
from neuronc.ir import Graph, Node, Op, Step
from neuronc.isa import ActFunc, AluOp, CollectiveOp, DType, Engine, Opcode, Space
from neuronc.neff.program import DebugLoc

WIDTH = 120  # a node's attributes wrap, one a line, past this many characters
INLINE_ELEMENTS = 16  # arrays up to this many elements print their values; longer ones their bytes
PLAN_MODULES = ("neuronc.plans",)  # every frozen dataclass, named tuple and enum defined there may be an attribute

_DTYPES = {d.name.lower(): d for d in DType}
_ENUMS = {cls.__name__: cls for cls in (Op, DType, ActFunc, AluOp, CollectiveOp, Engine, Opcode, Space)}
_CLASSES: dict = {"DebugLoc": DebugLoc}
_loaded = False


class IRParseError(NeuronCompileError):
    """IR text that cannot be read: says where (line and column) and what was expected."""


def register(cls: type) -> type:
    """Let `cls` (a dataclass, named tuple or enum) appear in attributes: printed and parsed by its name."""
    (_ENUMS if issubclass(cls, enum.Enum) else _CLASSES)[cls.__name__] = cls
    return cls


def _load_plan_types() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in PLAN_MODULES:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__ and (
                    (dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen)
                    or hasattr(value, "_fields") or issubclass(value, enum.Enum)):
                register(value)


# printing --------------------------------------------------------------------------------------------------------


def type_text(shape: tuple, dtype: DType) -> str:
    return "x".join([*map(str, shape), dtype.name.lower()])


def to_text(graph: Graph, elide_arrays_over: int | None = None) -> str:
    """The graph as text. With `elide_arrays_over`, arrays of more elements print as `array<...>...` (the debug
    folder elides weights so); such text cannot be parsed back."""
    _load_plan_types()
    nodes = graph.nodes()
    printer = _Printer({n: i for i, n in enumerate(nodes)}, elide_arrays_over)
    name = graph.name if re.fullmatch(r"[A-Za-z_]\w*", graph.name) else json.dumps(graph.name)
    lines = [f"graph @{name}({', '.join(printer.ref(p) for p in graph.params)}) {{"]
    lines += [printer.node(n) for n in nodes]
    lines.append(f"  return {', '.join(printer.ref(o) for o in graph.outputs)}".rstrip())
    lines.append("}")
    return "\n".join(lines) + "\n"


def node_text(node: Node, elide_arrays_over: int | None = 16) -> str:
    """One node as its line of text (never wrapped), nodes named by their display ids (`Node.id`)."""
    _load_plan_types()
    return _Printer(_DisplayIds(), elide_arrays_over, wrap=False).node(node).strip()


def attrs_text(attrs: dict) -> str:
    """A node's attributes on one line, every value printed whole (a node they name by its display id): equal
    texts, equal attributes (but for a NaN's bits, which the text prints alike)."""
    return _Printer(_DisplayIds(), None, wrap=False).value(attrs)


class _DisplayIds:
    """A numbering that names every node by its display id."""

    def __contains__(self, node) -> bool:
        return True

    def __getitem__(self, node: Node) -> int:
        return node.id


class _Printer:
    def __init__(self, number, elide: int | None, wrap: bool = True):
        self.number, self.elide, self.wrap = number, elide, wrap

    def ref(self, node: Node) -> str:
        if node not in self.number:
            raise ValueError(f"a node outside the graph is referred to: {node!r}")
        return f"%{self.number[node]}"

    def node(self, n: Node) -> str:
        head = f"  {self.ref(n)} = {n.op.name.lower()}({', '.join(self.ref(i) for i in n.inputs)}) : " \
               f"{type_text(n.shape, n.dtype)}"
        loc = "" if n.loc == DebugLoc() else \
            f"  loc({json.dumps(n.loc.file)}, {n.loc.line}, {json.dumps(n.loc.module_path)}, {json.dumps(n.loc.op)})"
        if not n.attrs:
            return head + loc
        attrs = [f"{self._key(k)} = {self.value(v)}" for k, v in n.attrs.items()]
        line = f"{head} {{{', '.join(attrs)}}}{loc}"
        if len(line) <= WIDTH or not self.wrap:
            return line
        attrs = [f"{self._key(k)} = {self.value(v, 6)}" for k, v in n.attrs.items()]
        return head + " {\n" + ",\n".join("      " + a for a in attrs) + "}" + loc

    @staticmethod
    def _key(key) -> str:
        if isinstance(key, str) and re.fullmatch(r"[A-Za-z_]\w*", key) and key not in ("inf", "nan"):  # (numbers)
            return key
        if isinstance(key, (str, int)) and not isinstance(key, bool):
            return json.dumps(key)
        raise TypeError(f"an attribute key must be a string or an integer, not {key!r}")

    def value(self, v, indent: int | None = None) -> str:
        """`v` on one line; with `indent` (the column its line starts at), over several lines when it is too long:
        its items filled into lines of at most WIDTH characters, an item too long for a line broken in turn."""
        flat = self._flat(v)
        if indent is None or len(flat) + indent <= WIDTH:
            return flat
        inner = indent + 4
        items = self._items(v, inner)
        if items is None:
            return flat
        opening, closing, parts = items
        lines, line = [], ""
        for k, part in enumerate(parts):
            part += "," if k < len(parts) - 1 else closing
            if "\n" not in part and inner + len(line) + 1 + len(part) <= WIDTH:
                line = f"{line} {part}" if line else part
                continue
            if line:
                lines.append(line)
            line = part
        lines.append(line)
        return opening + "\n" + "\n".join(" " * inner + text for text in lines)

    def _items(self, v, indent: int):
        """(opening, closing, item texts) of a container printed over several lines, or None for a leaf."""
        if isinstance(v, Step):
            return None
        if isinstance(v, tuple) and not _is_special(v):
            return "(", ")", [self.value(x, indent) for x in v]
        if isinstance(v, list):
            return "[", "]", [self.value(x, indent) for x in v]
        if isinstance(v, dict):
            return "{", "}", [f"{self._key(k)} = {self.value(x, indent)}" for k, x in v.items()]
        if _is_record(v):
            return f"{type(v).__name__}(", ")", [f"{k}={self.value(x, indent)}" for k, x in _fields(v)]
        return None

    def _flat(self, v) -> str:
        if v is None:
            return "none"
        if isinstance(v, enum.Enum):  # before int: DType and the ISA's enums are IntEnums
            cls = type(v).__name__
            if _ENUMS.get(cls) is not type(v):
                raise TypeError(f"cannot print {v!r}: register its enum class (ir_text.register)")
            return f"{cls}.{v.name}"
        if isinstance(v, np.generic):  # before float: np.float64 is a float
            return f"scalar<{DType.from_numpy(v.dtype).name.lower()}>({_number(v.item())})"
        if isinstance(v, (bool, int, float)):
            return _number(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, Node):
            return self.ref(v)
        if isinstance(v, Step):
            return self._step(v)
        if isinstance(v, np.ndarray):
            return self._array(v)
        if isinstance(v, tuple) and not _is_record(v):
            inner = ", ".join(map(self._flat, v))
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        if isinstance(v, list):
            return f"[{', '.join(map(self._flat, v))}]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{self._key(k)} = {self._flat(x)}" for k, x in v.items()) + "}"
        if _is_record(v):
            if _CLASSES.get(type(v).__name__) is not type(v):
                raise TypeError(f"cannot print a {type(v).__name__}: define it in neuronc/plans.py or register it "
                                f"(ir_text.register)")
            return f"{type(v).__name__}(" + ", ".join(f"{k}={self._flat(x)}" for k, x in _fields(v)) + ")"
        raise TypeError(f"cannot print an attribute of type {type(v).__name__}: {v!r}")

    def _step(self, step: Step) -> str:
        args = []
        for kind, ref in step.args:
            args.append(f"in{ref}" if kind == "input" else f"s{ref}" if kind == "step" else self._flat(ref))
        text = f"{step.op.name.lower()}({', '.join(args)}) : {step.dtype.name.lower()}"
        if step.attrs:
            text += " {" + ", ".join(f"{self._key(k)} = {self._flat(x)}" for k, x in step.attrs.items()) + "}"
        return text

    def _array(self, a: np.ndarray) -> str:
        head = f"array<{type_text(a.shape, DType.from_numpy(a.dtype))}>"
        if self.elide is not None and a.size > self.elide:
            return head + "..."
        with np.errstate(invalid="ignore"):
            nan = DType.from_numpy(a.dtype).is_float and bool(np.isnan(a.astype(np.float64)).any())
        if a.size <= INLINE_ELEMENTS and not nan:  # (a NaN's sign and payload are kept in the bytes only)
            return head + "[" + ", ".join(_number(x.item()) for x in a.reshape(-1)) + "]"
        little = a.astype(a.dtype.newbyteorder("<"), copy=False)
        return head + "0x" + np.ascontiguousarray(little).tobytes().hex()


def _number(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "nan"
    return repr(float(v))  # "inf", "-inf", or the shortest text that reads back as the same float64


def _is_record(v) -> bool:
    return (dataclasses.is_dataclass(v) and not isinstance(v, type)) or (isinstance(v, tuple) and hasattr(v, "_fields"))


def _is_special(v) -> bool:
    return isinstance(v, Step) or _is_record(v)


def _fields(v) -> list:
    if dataclasses.is_dataclass(v):
        return [(f.name, getattr(v, f.name)) for f in dataclasses.fields(v) if f.init]
    return list(zip(v._fields, v))


# parsing ---------------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<space>(?:\s|//[^\n]*)+)
  | (?P<node>%\d+)
  | (?P<hex>0x[0-9a-fA-F]*)
  | (?P<number>-?(?:inf|nan|\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)(?![\w.]))
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<name>[A-Za-z_][\w]*)
  | (?P<punct>\.\.\.|[()\[\]{},=:<>@.])
""", re.VERBOSE)
_TYPE = re.compile(r"((?:\d+x)*)(" + "|".join(sorted(_DTYPES, key=len, reverse=True)) + r")\b")


def parse(text: str) -> Graph:
    """The graph `text` describes (as `to_text` prints it): new nodes, with fresh ids."""
    _load_plan_types()
    return _Parser(text).graph()


class _Parser:
    def __init__(self, text: str):
        self.text, self.pos = text, 0
        self.nodes: dict = {}  # number -> Node

    # scanning
    def _skip(self) -> None:
        match = _TOKEN.match(self.text, self.pos)
        while match and match.lastgroup == "space":
            self.pos = match.end()
            match = _TOKEN.match(self.text, self.pos)

    def peek(self) -> tuple:
        """(kind, text) of the next token, ("end", "") at the end."""
        self._skip()
        if self.pos >= len(self.text):
            return "end", ""
        match = _TOKEN.match(self.text, self.pos)
        if match is None:
            raise self.error("an unexpected character")
        return match.lastgroup, match.group()

    def take(self, kind: str | None = None, text: str | None = None) -> str:
        got_kind, got = self.peek()
        if (kind and got_kind != kind) or (text is not None and got != text):
            raise self.error(f"expected {text or kind}, found {got!r}" if got else f"expected {text or kind}")
        self.pos += len(got)
        return got

    def accept(self, text: str) -> bool:
        if self.peek()[1] == text:
            self.pos += len(text)
            return True
        return False

    def error(self, what: str) -> IRParseError:
        line = self.text.count("\n", 0, self.pos) + 1
        column = self.pos - (self.text.rfind("\n", 0, self.pos) + 1) + 1
        source = self.text.splitlines()[line - 1] if self.text.splitlines()[line - 1:] else ""
        return IRParseError(f"IR text, line {line}, column {column}: {what}",
                            problems=[source.strip()] if source.strip() else [],
                            hint="the IR text format is described in neuronc/ir_text.py")

    def type_(self) -> tuple:
        self._skip()
        match = _TYPE.match(self.text, self.pos)
        if match is None:
            raise self.error("expected a type such as 8x32xf32")
        self.pos = match.end()
        dims = tuple(int(d) for d in match.group(1).split("x") if d)
        return dims, _DTYPES[match.group(2)]

    # structure
    def graph(self) -> Graph:
        self.take("name", "graph")
        self.take(text="@")
        kind, name = self.peek()
        name = json.loads(self.take("string")) if kind == "string" else self.take("name")
        self.take(text="(")
        params = self._refs(")", forward=True)
        self.take(text="{")
        while self.peek()[0] == "node":
            self.node()
        self.take("name", "return")
        outputs = [] if self.peek()[1] == "}" else [self._node_ref() for _ in self._comma_separated("}")]
        self.take(text="}")
        if self.peek()[0] != "end":
            raise self.error("expected the end of the text after the graph")
        params = [self._resolve(p) for p in params]
        if any(p.op is not Op.PARAMETER for p in params):
            raise self.error("a graph's parameters must be parameter nodes")
        return Graph(params, outputs, name)

    def _comma_separated(self, closing: str):
        """Yields once per item of a comma-separated list ending before `closing` (the caller reads the item)."""
        yield
        while self.accept(","):
            if self.peek()[1] == closing:
                return
            yield

    def _refs(self, closing: str, forward: bool = False) -> list:
        refs = []
        if not self.accept(closing):
            for _ in self._comma_separated(closing):
                refs.append(int(self.take("node")[1:]) if forward else self._node_ref())
            self.take(text=closing)
        return refs

    def _node_ref(self) -> Node:
        return self._resolve(int(self.take("node")[1:]))

    def _resolve(self, number: int) -> Node:
        if number not in self.nodes:
            raise self.error(f"%{number} is used before it is defined")
        return self.nodes[number]

    def node(self) -> None:
        number = int(self.take("node")[1:])
        if number in self.nodes:
            raise self.error(f"%{number} is defined twice")
        self.take(text="=")
        op = self._op(self.take("name"))
        self.take(text="(")
        inputs = self._refs(")")
        self.take(text=":")
        shape, dtype = self.type_()
        attrs = self._dict() if self.peek()[1] == "{" else {}
        loc = DebugLoc()
        if self.peek() == ("name", "loc"):
            self.take()
            self.take(text="(")
            file = json.loads(self.take("string"))
            self.take(text=",")
            line = int(self.take("number"))
            self.take(text=",")
            module_path = json.loads(self.take("string"))
            self.take(text=",")
            loc = DebugLoc(file, line, module_path, json.loads(self.take("string")))
            self.take(text=")")
        self.nodes[number] = Node(op, tuple(inputs), shape, dtype, attrs, loc)

    def _op(self, name: str) -> Op:
        if name.upper() not in Op.__members__ or name != name.lower():
            raise self.error(f"no op {name!r} in the IR (neuronc/op_facts.py lists them)")
        return Op[name.upper()]

    # values
    def _dict(self) -> dict:
        self.take(text="{")
        result: dict = {}
        if not self.accept("}"):
            for _ in self._comma_separated("}"):
                kind, key = self.peek()
                if kind == "name":
                    key = self.take()
                elif kind == "string":
                    key = json.loads(self.take())
                else:
                    key = int(self.take("number"))
                self.take(text="=")
                result[key] = self.value()
            self.take(text="}")
        return result

    def value(self):
        kind, text = self.peek()
        if kind == "number":
            self.take()
            return float(text) if re.search(r"[.eEna]", text) else int(text)
        if kind == "string":
            return json.loads(self.take())
        if kind == "node":
            return self._node_ref()
        if text == "(":
            return tuple(self._sequence("(", ")"))
        if text == "[":
            return self._sequence("[", "]")
        if text == "{":
            return self._dict()
        if kind != "name":
            raise self.error(f"expected a value, found {text!r}")
        self.take()
        if text in ("none", "true", "false"):
            return {"none": None, "true": True, "false": False}[text]
        if text == "array":
            return self._array_value()
        if text == "scalar":
            self.take(text="<")
            dtype = self._dtype()
            self.take(text=">")
            self.take(text="(")
            number = self.value()
            self.take(text=")")
            return dtype.numpy.type(number)
        if text in _ENUMS and self.peek()[1] == ".":
            self.take(text=".")
            member = self.take("name")
            if member not in _ENUMS[text].__members__:
                raise self.error(f"{text} has no member {member}")
            return _ENUMS[text][member]
        if text in _CLASSES:
            return self._record(_CLASSES[text])
        if text.upper() in Op.__members__ and text == text.lower():
            return self._step(Op[text.upper()])
        raise self.error(f"unknown name {text!r} (a plan type must be defined in neuronc/plans.py)")

    def _sequence(self, opening: str, closing: str) -> list:
        self.take(text=opening)
        items = []
        if not self.accept(closing):
            for _ in self._comma_separated(closing):
                items.append(self.value())
            self.take(text=closing)
        return items

    def _dtype(self) -> DType:
        name = self.take("name")
        if name not in _DTYPES:
            raise self.error(f"unknown dtype {name!r}")
        return _DTYPES[name]

    def _record(self, cls: type):
        self.take(text="(")
        fields: dict = {}
        if not self.accept(")"):
            for _ in self._comma_separated(")"):
                name = self.take("name")
                self.take(text="=")
                fields[name] = self.value()
            self.take(text=")")
        try:
            return cls(**fields)
        except TypeError as why:
            raise self.error(f"cannot make a {cls.__name__} of these fields: {why}") from None

    def _step(self, op: Op) -> Step:
        self.take(text="(")
        args = []
        if not self.accept(")"):
            for _ in self._comma_separated(")"):
                kind, text = self.peek()
                if kind == "name" and re.fullmatch(r"(in|s)\d+", text):
                    self.take()
                    args.append(("input", int(text[2:])) if text.startswith("in") else ("step", int(text[1:])))
                else:
                    args.append(("imm", self.value()))
            self.take(text=")")
        self.take(text=":")
        dtype = self._dtype()
        attrs = self._dict() if self.peek()[1] == "{" else {}
        return Step(op, tuple(args), dtype, attrs)

    def _array_value(self) -> np.ndarray:
        self.take(text="<")
        shape, dtype = self.type_()
        self.take(text=">")
        kind, text = self.peek()
        if text == "...":
            raise self.error("this array was elided when the text was printed; print it with the arrays to parse it")
        if kind == "hex":
            self.take()
            data = bytes.fromhex(text[2:])
            little = dtype.numpy.newbyteorder("<")
            if len(data) != int(np.prod(shape, dtype=np.int64)) * little.itemsize:
                raise self.error(f"{len(data)} bytes do not make a {type_text(shape, dtype)} array")
            return np.frombuffer(data, little).astype(dtype.numpy).reshape(shape)
        values = self._sequence("[", "]")
        if len(values) != int(np.prod(shape, dtype=np.int64)):
            raise self.error(f"{len(values)} values do not make a {type_text(shape, dtype)} array")
        if not all(isinstance(v, (bool, int, float)) for v in values):
            raise self.error("an array's values must be numbers or booleans")
        if not dtype.is_float and all(isinstance(v, (bool, int)) for v in values):  # exactly: numpy reads a list
            return np.array(values, dtype=dtype.numpy).reshape(shape)  # holding ints past int64's range as float64
        return np.array(values).astype(dtype.numpy).reshape(shape)
