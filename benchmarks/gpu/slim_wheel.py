"""Drop what kvbridge never loads from the NIXL wheel, so that the wheels carried to a GPU machine stay small.

    python benchmarks/gpu/slim_wheel.py benchmarks/gpu/wheels/nixl_cu13-1.5.1-*.whl

Removes the ``nixl_ep_cu13`` package (NIXL EP: expert-parallel kernels for three torch versions, 26.6 MiB
compressed of the 56 MiB wheel; a separate top-level package that ``nixl_cu13`` never imports) and its
lines in the wheel's RECORD; rewrites the wheel in place under the same name. Idempotent.
"""
from __future__ import annotations

import os
import sys
import zipfile

DROP = ("nixl_ep_cu13/",)


def slim(path: str) -> tuple[int, int]:
    before = os.path.getsize(path)
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(DROP):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not any(line.startswith(d.encode()) for d in DROP))
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, path)
    return before, os.path.getsize(path)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        b, a = slim(p)
        print(f"{os.path.basename(p)}: {b:,} -> {a:,} bytes")
