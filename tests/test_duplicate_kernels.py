"""passes/duplicate_kernels.py: an elementwise kernel made twice from the same inputs is made once."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from neuronc.compiler import CompileOptions, compile_exported
from neuronc.errors import NeuronRuntimeError
from neuronc.ir import Op
from runtime import run_neff
from tests.conftest import assert_matches_eager
from tests.test_ops import Fn


def test_indices_read_by_a_gather_and_a_scatter_become_table_rows_in_one_kernel():
    """The MoE model's routed token numbers index both the gathered tokens and the index_add back onto them; each
    gather and scatter clamps and converts its indices to int32 rows, and after fusion the two copies were two
    kernels. At -O2 they are one, the result is -O0's bits and eager's values, and an index outside is refused."""
    fn = Fn(lambda x, i: torch.zeros_like(x).index_add(0, i, x[i] * 2))
    x, idx = torch.randn(6, 4), torch.tensor([4, 0, 4, 5, 1])
    program = torch.export.export(fn, (x, idx))
    compiled = {level: compile_exported(program, CompileOptions(opt_level=level)) for level in (0, 2)}
    rows = [n for n in compiled[2].graph.nodes()
            if n.op is Op.FUSED and [s.op for s in n.attrs["body"]] == [Op.MAXIMUM, Op.MINIMUM, Op.CONVERT]]
    assert len(rows) == 1
    outputs = [run_neff(compiled[level].neff, [x.numpy(), idx.numpy()]).outputs[0] for level in (0, 2)]
    np.testing.assert_array_equal(outputs[0].view(np.uint32), outputs[1].view(np.uint32))
    assert_matches_eager(torch.from_numpy(outputs[1]), fn(x, idx))
    with pytest.raises(NeuronRuntimeError, match="outside the table's 6 rows"):
        run_neff(compiled[2].neff, [x.numpy(), np.array([4, 0, 6, 5, 1])])
