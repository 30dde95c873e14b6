"""Regenerate neuronc/neff/generated/ from neff.fbs with flatc, or check that it is up to date.

The generated flatbuffer code and the binary schema are committed, so that neuronc needs no flatc
at run time; this script is the one way they are made, and `--check` (run by the tests) catches
a schema edit that was not followed by a regeneration.

    python -m neuronc.neff.regenerate            # rewrite the generated files
    python -m neuronc.neff.regenerate --check    # exit 1, listing the stale files, if any differ
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
SCHEMA = HERE / "neff.fbs"
GENERATED = HERE / "generated"
# The schema's namespace, which is also where flatc puts the Python modules under its output dir.
PACKAGE_PATH = pathlib.Path("neuronc", "neff", "generated")


def flatc_path() -> str | None:
    return shutil.which("flatc")


def flatc_version() -> str:
    return subprocess.run([flatc_path(), "--version"], capture_output=True, text=True).stdout.strip()


def fresh_files() -> dict:
    """Run flatc into a temporary directory; return {file name: bytes} of what belongs in generated/."""
    flatc = flatc_path()
    if flatc is None:
        raise RuntimeError("flatc is not installed (Debian/Ubuntu: apt-get install flatbuffers-compiler)")
    with tempfile.TemporaryDirectory() as tmp:
        package_dir = pathlib.Path(tmp, PACKAGE_PATH)
        # Run from the schema's directory with a relative name: the binary schema records no path.
        subprocess.run([flatc, "--python", "-o", tmp, SCHEMA.name], cwd=HERE, check=True)
        subprocess.run(
            [flatc, "--binary", "--schema", "--bfbs-builtins", "-o", str(package_dir), SCHEMA.name],
            cwd=HERE,
            check=True,
        )
        return {path.name: path.read_bytes() for path in sorted(package_dir.iterdir()) if path.is_file()}


def stale_files(fresh: dict) -> list:
    """Names of committed generated files that differ from `fresh`, are missing, or are no longer made."""
    current = {}
    if GENERATED.is_dir():
        current = {path.name: path.read_bytes() for path in GENERATED.iterdir() if path.is_file()}
    return sorted(name for name in fresh.keys() | current.keys() if fresh.get(name) != current.get(name))


def check() -> list:
    """The stale generated files (empty: up to date)."""
    return stale_files(fresh_files())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neuronc.neff.regenerate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if any generated file is stale")
    args = parser.parse_args(argv)
    fresh = fresh_files()
    stale = stale_files(fresh)
    if args.check:
        if stale:
            print(f"stale files in {GENERATED} (run `python -m neuronc.neff.regenerate`):", file=sys.stderr)
            print(f"  (compared with the output of {flatc_version()})", file=sys.stderr)
            for name in stale:
                print(f"  {name}", file=sys.stderr)
            return 1
        print(f"{GENERATED} is up to date")
        return 0
    GENERATED.mkdir(exist_ok=True)
    for name in stale:
        if name in fresh:
            (GENERATED / name).write_bytes(fresh[name])
            print(f"wrote {name}")
        else:
            (GENERATED / name).unlink()
            print(f"removed {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
