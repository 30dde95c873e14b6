"""CPU seconds of the runtime's load and of its access check (LoadedProgram._check_accesses) alone, for saved
NEFFs or for the forward of one OpInfo sample compiled here (issue 24: the check is the slowest step a user meets
on big programs).

    .venv/bin/python -m benchmarks.access_check --op grid_sampler_3d --sample 2 --save /tmp/gs3d.neff
    .venv/bin/python -m benchmarks.access_check /tmp/gs3d.neff
"""
from __future__ import annotations

import argparse
import time

import torch

from neuronc import neff as neff_files
from runtime import NeuronCore
from runtime.core import LoadedProgram


def opinfo_forward(name: str, sample: int):
    """The NEFF of ``op(sample)``'s forward (float32 sample number ``sample`` of OpInfo op ``name``)."""
    from torch.testing._internal.common_methods_invocations import op_db

    from neuronc.compiler import compile_exported

    op = next(o for o in op_db if o.name == name)
    s = list(op.sample_inputs("cpu", torch.float32))[sample]
    tensors = [a for a in s.args if isinstance(a, torch.Tensor)]
    rest = [a for a in s.args if not isinstance(a, torch.Tensor)]

    class Op(torch.nn.Module):
        def forward(self, x, *args):
            return op.op(x, *args, *rest, **s.kwargs)

    return compile_exported(torch.export.export(Op(), (s.input, *tensors))).neff


def timed_load(neff) -> tuple:
    """(load, access check) CPU seconds of loading ``neff`` on a fresh trn2 core."""
    spent, check = [], LoadedProgram._check_accesses

    def timed(program):
        start = time.process_time()
        check(program)
        spent.append(time.process_time() - start)

    LoadedProgram._check_accesses = timed
    try:
        start = time.process_time()
        NeuronCore("trn2").load(neff)
        return time.process_time() - start, spent[0]
    finally:
        LoadedProgram._check_accesses = check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("neffs", nargs="*", help="saved NEFF files")
    parser.add_argument("--op", help="an OpInfo op name: compile its forward here")
    parser.add_argument("--sample", type=int, default=0, help="which float32 sample of --op")
    parser.add_argument("--save", help="save --op's NEFF to this path")
    args = parser.parse_args()
    programs = [(path, neff_files.load(path)) for path in args.neffs]
    if args.op:
        neff = opinfo_forward(args.op, args.sample)
        if args.save:
            neff_files.save(neff, args.save)
        programs.append((f"{args.op} sample {args.sample}", neff))
    for name, neff in programs:
        load, check = timed_load(neff)
        instructions = sum(len(stream) for stream in neff.streams.values())
        print(f"{name}: {instructions} instructions, load {load:.2f} s CPU, of which the access check {check:.2f} s")


if __name__ == "__main__":
    main()
