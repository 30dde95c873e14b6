"""What every pass is given besides the graph: one `PassContext` per compilation.

Every pass is a function `(graph, ctx) -> graph` (passes/pipeline.py lists them per optimisation level). The
context holds what a pass may weigh that is not in the graph: the target (its SBUF budget, its cost model),
the optimisation level and the auto-cast options; how to price a finished graph (``price``: the compiler's
emitted program timed by the cost model, set by neuronc.compiler; passes never import codegen; ``kernel_time``,
one planned kernel emitted alone and timed, the same way); and what the run
records: the rewrite rules that fired, the priced decisions taken.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

from neuronc.passes.auto_cast import AutoCast
from neuronc.targets import Target, get_target


@dataclasses.dataclass
class PassContext:
    target: Target = dataclasses.field(default_factory=get_target)
    opt_level: int = 2
    cast: AutoCast = dataclasses.field(default_factory=AutoCast)
    verify: bool = False  # check the graph (ir_verifier) after every pass
    fired: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # rewrite rule -> times
    # The estimated ns of a graph that has run every pass (None: the pipeline takes no priced decision).
    price: Callable | None = None
    # (emulated ns, instructions) of one planned kernel compiled alone (neuronc.kernel_timing, set by
    # neuronc.compiler; None: the planners price with their formulas alone).
    kernel_time: Callable | None = None
    # The same timing for the few choices made by their kernel's time at -O2 too (a folded norm's prologue schedule:
    # passes/norm_prologue.py; an attention's first heads made from rows: passes/attention.py; each a few kernels per
    # distinct node; None: by their own prices).
    choice_time: Callable | None = None
    # Priced pass -> (estimated ns with it, without it) of the decision taken (pipeline.PRICED).
    decisions: dict = dataclasses.field(default_factory=dict)
