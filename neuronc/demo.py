"""`make demo`: a model goes through the whole toolchain, the way a user would drive it.

Builds a small transformer-style model, saves it with torch.export.save, compiles it with the
`neuronc` command line, runs the NEFF on the emulated NeuronCore, and compares with eager PyTorch.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class DemoModel(nn.Module):
    def __init__(self, width=64, classes=10):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return torch.softmax(self.head(x), dim=-1)


def neuronc_command() -> list:
    exe = shutil.which("neuronc", path=os.path.dirname(sys.executable)) or shutil.which("neuronc")
    return [exe] if exe else [sys.executable, "-m", "neuronc.cli"]


def main(out_dir: str = "demo_out") -> int:
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    model = DemoModel().eval()
    x = torch.randn(16, 64)
    pt2, neff, x_path, out_path = (os.path.join(out_dir, f) for f in ("demo.pt2", "demo.neff", "x.npy", "out.npz"))

    print(f"1. torch.export.save -> {pt2}")
    torch.export.save(torch.export.export(model, (x,)), pt2)
    np.save(x_path, x.numpy())
    for step, args in (("2. neuronc compile", ["compile", pt2, "-o", neff]),
                       ("3. neuronc inspect", ["inspect", neff]),
                       ("4. neuronc run", ["run", neff, "--input", x_path, "--output", out_path])):
        print(f"{step}")
        done = subprocess.run(neuronc_command() + args, text=True, capture_output=True)
        print("   " + done.stdout.strip().replace("\n", "\n   "))
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return done.returncode

    with torch.no_grad():
        expected = model(x).numpy()
    with np.load(out_path, allow_pickle=False) as outputs:
        got = outputs["output0"]
    error = float(np.max(np.abs(got - expected)))
    ok = np.allclose(got, expected, rtol=1e-4, atol=1e-5)
    print(f"5. agreement with PyTorch eager (fp32, rtol 1e-4, atol 1e-5): {'MATCH' if ok else 'MISMATCH'}, "
          f"max abs error {error:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
