"""PEP 517 build backend for memscope-markers: setuptools, plus a wheel writer for machines
without the `wheel` package.

setuptools before 70.1 builds wheels only through the separate `wheel` package, and an offline
`pip install --no-build-isolation` cannot fetch it. When setuptools can build wheels itself
(70.1+) or `wheel` is importable, every hook is setuptools' own. Otherwise build_wheel compiles
with `setup.py build` and `setup.py egg_info` (neither needs `wheel`) into a temporary directory
and zips the result with the dist-info files a wheel needs (METADATA from PKG-INFO, WHEEL,
top_level.txt, RECORD); the hooks that only setuptools+wheel can serve (metadata preparation,
editable installs) are then absent, and pip falls back to build_wheel for metadata.
"""

import base64
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

from setuptools import build_meta as _st


def _setuptools_builds_wheels():
    try:
        import setuptools.command.bdist_wheel  # noqa: F401  (setuptools >= 70.1)
        return True
    except ImportError:
        pass
    try:
        import wheel.bdist_wheel  # noqa: F401
        return True
    except ImportError:
        return False


build_sdist = _st.build_sdist
get_requires_for_build_sdist = _st.get_requires_for_build_sdist

if _setuptools_builds_wheels():
    build_wheel = _st.build_wheel
    get_requires_for_build_wheel = _st.get_requires_for_build_wheel
    prepare_metadata_for_build_wheel = _st.prepare_metadata_for_build_wheel
    build_editable = _st.build_editable
    get_requires_for_build_editable = _st.get_requires_for_build_editable
    prepare_metadata_for_build_editable = _st.prepare_metadata_for_build_editable
else:

    def get_requires_for_build_wheel(config_settings=None):
        return []

    def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
        return _build_wheel_without_wheel_package(wheel_directory)


def _run_setup(*args):
    cmd = [sys.executable, "setup.py", *args]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout)
        raise RuntimeError(f"memscope-markers build: `{' '.join(cmd)}` failed (exit {done.returncode}); "
                           "its output is above")


def _wheel_tag():
    soabi = sysconfig.get_config_var("SOABI") or ""  # e.g. cpython-311-x86_64-linux-gnu, cpython-313t-...
    parts = soabi.split("-")
    if sys.implementation.name != "cpython" or len(parts) < 2 or parts[0] != "cpython":
        raise RuntimeError(f"memscope-markers build: the built-in wheel writer knows CPython only (SOABI {soabi!r}); "
                           "install the `wheel` package or setuptools >= 70.1 and build again")
    python = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    abi = "cp" + parts[1]
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{python}-{abi}-{platform}"


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _build_wheel_without_wheel_package(wheel_directory):
    with tempfile.TemporaryDirectory(prefix="memscope-build-") as tmp:
        lib = os.path.join(tmp, "lib")
        _run_setup("build", "--build-base", os.path.join(tmp, "build"), "--build-lib", lib)
        _run_setup("egg_info", "--egg-base", tmp)
        (egg_info,) = [d for d in os.listdir(tmp) if d.endswith(".egg-info")]
        egg_info = os.path.join(tmp, egg_info)
        with open(os.path.join(egg_info, "PKG-INFO"), encoding="utf-8") as f:
            metadata = f.read()
        fields = dict(line.split(": ", 1) for line in metadata.splitlines() if ": " in line and not line[0].isspace())
        name = fields["Name"].replace("-", "_")
        version = fields["Version"]
        tag = _wheel_tag()
        dist_info = f"{name}-{version}.dist-info"
        wheel_name = f"{name}-{version}-{tag}.whl"

        files = []
        for root, dirs, names in os.walk(lib):
            dirs.sort()
            for n in sorted(names):
                full = os.path.join(root, n)
                files.append((os.path.relpath(full, lib).replace(os.sep, "/"), full))
        meta_files = {
            "METADATA": metadata.encode("utf-8"),
            "WHEEL": (f"Wheel-Version: 1.0\nGenerator: memscope_build_backend\nRoot-Is-Purelib: false\n"
                      f"Tag: {tag}\n").encode(),
        }
        top_level = os.path.join(egg_info, "top_level.txt")
        if os.path.exists(top_level):
            with open(top_level, "rb") as f:
                meta_files["top_level.txt"] = f.read()

        os.makedirs(wheel_directory, exist_ok=True)
        out = os.path.join(wheel_directory, wheel_name)
        record = []
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for arc, full in files:
                with open(full, "rb") as f:
                    data = f.read()
                info = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = (os.stat(full).st_mode & 0o777 | 0o100000) << 16  # keep the mode bits
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, data)
                record.append(_record_line(arc, data))
            for n, data in meta_files.items():
                arc = f"{dist_info}/{n}"
                zf.writestr(arc, data)
                record.append(_record_line(arc, data))
            record.append(f"{dist_info}/RECORD,,")
            zf.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
        return wheel_name
