"""Build of the C extension memscope._native, which carries the USDT probe sites.

Kept in setup.py because the flags matter for the probes: -O2 for a short untraced path, and
-fno-omit-frame-pointer so the tracer's stack walks through our frames work. The metadata is in
pyproject.toml.
"""

import sys

from setuptools import Extension, setup

if not sys.platform.startswith("linux"):
    # The probes are ELF notes; elsewhere the extension builds without them (markers become no-ops).
    print("memscope-markers: not Linux, building without USDT probes (the markers do nothing)", file=sys.stderr)

setup(
    ext_modules=[
        Extension(
            "memscope._native",
            sources=["src/memscope/_native.c"],
            depends=["src/memscope/memscope_usdt.h"],
            extra_compile_args=["-O2", "-fno-omit-frame-pointer", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ],
)
