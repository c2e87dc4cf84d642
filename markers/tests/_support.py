"""Shared test helpers: importing the installed package with a useful error, and recording what
the native layer would send to the tracer.

The tests run against an *installed* build (the probes live in the compiled extension), so a
missing install must say how to make one rather than fail with a bare ImportError.
"""

import contextlib

try:
    import memscope
    from memscope import _native
except ImportError as e:  # pragma: no cover - environment problem, not a test failure
    raise ImportError(
        f"memscope is not importable ({e}). Build and install it first, then point PYTHONPATH at it:\n"
        "  python3 -m pip install --no-build-isolation --no-deps --target /tmp/memscope-markers markers\n"
        "  PYTHONPATH=/tmp/memscope-markers python3 -m unittest discover -s markers/tests -v") from e

__all__ = ["memscope", "_native", "recording"]


@contextlib.contextmanager
def recording():
    """Collect (probe, args) for every marker call made inside the block, through the native test
    hook, i.e. after the same argument checks a traced call goes through."""
    calls = []
    previous = _native._set_test_hook(lambda probe, args: calls.append((probe, args)))
    try:
        yield calls
    finally:
        _native._set_test_hook(previous)
