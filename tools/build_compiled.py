"""Compile the simulator's hot modules (`testbed.compiled.MODULES`) with mypyc, beside their sources.

Run by `make install` where a C compiler is (`COMPILED=0` skips it and removes a build); `--clean`
removes the built modules. The build happens in a scratch directory (so the project's own
packaging settings are not read by the extension build) and its extension modules are copied
into the package with the sources' signature, which `testbed.compiled` checks at import.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed import compiled  # noqa: E402


def built_files() -> list[Path]:
    """Every build's output in the package (an earlier build may have compiled other modules)."""
    pkg = ROOT / "testbed"
    out = sorted({p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in pkg.rglob(f"*{suffix}")})
    stamp = pkg / compiled.STAMP_FILE
    return [*out, stamp] if stamp.exists() else out


def clean() -> None:
    for p in built_files():
        p.unlink()


def build() -> None:
    from mypyc.build import mypycify
    from setuptools import Distribution

    clean()
    # Taken before compiling: a source edited during the build then makes the build stale, never
    # a build of the old text stamped with the new one's signature.
    signature = compiled.signature()
    sources = [str(compiled.source_path(m)) for m in compiled.MODULES]
    with tempfile.TemporaryDirectory(prefix="testbed-compiled-") as tmp:
        here = os.getcwd()
        os.chdir(tmp)
        try:
            exts = mypycify(
                ["--config-file", str(ROOT / "pyproject.toml"), *sources],
                group_name=compiled.GROUP,
                target_dir=str(Path(tmp) / "c"),
            )
            dist = Distribution({"name": "testbed-compiled", "ext_modules": exts})
            cmd = dist.get_command_obj("build_ext")
            cmd.build_lib = str(Path(tmp) / "lib")
            cmd.build_temp = str(Path(tmp) / "obj")
            cmd.parallel = os.cpu_count() or 1
            dist.run_command("build_ext")
        finally:
            os.chdir(here)
        lib = Path(tmp) / "lib"
        for so in lib.rglob("*"):
            if so.is_file():
                dest = ROOT / so.relative_to(lib)
                shutil.copy2(so, dest)
    # Written last: a build that failed half-way has no stamp, and nothing of it is used.
    (ROOT / "testbed" / compiled.STAMP_FILE).write_text(signature + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clean", action="store_true", help="remove the built modules instead")
    args = ap.parse_args()
    if args.clean:
        clean()
        return
    build()
    print(f"compiled {len(compiled.MODULES)} modules with mypyc (testbed/compiled.py)")


if __name__ == "__main__":
    main()
