"""The collective kernel: one instruction of the collective engine, from the input's HBM buffer to the output's.

Its ordering with the kernels around it is the sync pass's, as for any engine: it waits for the stores of its
input, and what reads its output waits for it; kernels that need neither run meanwhile (the compute it overlaps).
"""
from __future__ import annotations

from neuronc.codegen.emitter import Emitter, hbm
from neuronc.ir import Node
from neuronc.isa import COLLECTIVES, Engine
from neuronc.plans import MemoryPlan

OPCODES = {op: opcode for opcode, op in COLLECTIVES.items()}


def collective(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    x = node.inputs[0]
    em.emit(OPCODES[node.attrs["collective"]], Engine.COLLECTIVE, hbm(node.dtype, plan.offset(node), ((1, node.size),)),
            hbm(x.dtype, plan.offset(x), ((1, x.size),)), alu=node.attrs["reduce"], imm0=float(node.attrs["ranks"]),
            imm1=float(node.attrs["group"]))
