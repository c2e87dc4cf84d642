"""memscope.msmemscope: msMemScope's Python API on top of memscope's markers, so a script written
for msMemScope (``import msmemscope``) runs under memscope-bpf by changing only its import:
``from memscope import msmemscope``.

Only the parts that make sense for a tracer outside the process are here: ``config()`` keeps
msMemScope's argument checking but does not configure anything (the tracer's command line
does); ``start()``/``stop()``/``step()`` are the collect and step markers; the ``describe``
submodule is the owner-tagging API.
"""

from .. import _native
from . import describe  # noqa: F401  (msmemscope.describe is a submodule there too)

__all__ = ["config", "get_config", "start", "stop", "step", "describe"]

# msMemScope's keys (event_trace_manager.cpp parserConfigTable); data_format and output are its
# legacy names for format and output_path.
CONFIG_KEYS = ("device", "level", "events", "call_stack", "analysis", "watch", "format", "output_path",
               "data_format", "output")

_config = {}


def config(*args, **kwargs):
    """Record msMemScope options (keyword only, every value a str), checked as msMemScope checks
    them. They are kept for the script (see :func:`get_config`) and do not change what the tracer
    collects: pass the equivalent ``memscope-bpf trace`` flags for that."""
    if args:
        raise TypeError("msmemscope.config() takes keyword arguments only, e.g. config(events='alloc,free')")
    for key, value in kwargs.items():
        if key not in CONFIG_KEYS:
            raise ValueError(f"msmemscope.config(): unknown option {key!r}; the options are {', '.join(CONFIG_KEYS)}")
        if not isinstance(value, str):
            raise TypeError(f"msmemscope.config(): option {key!r} must be a str (as msMemScope requires), "
                            f"not {type(value).__name__}; e.g. {key}='{value}'")
    _config.update(kwargs)


def get_config():
    """A copy of the options given to :func:`config` so far."""
    return dict(_config)


def start():
    """Start collection (probe ``collect(1)``)."""
    _native.collect(1)


def stop():
    """Stop collection (probe ``collect(0)``)."""
    _native.collect(0)


step = _native.step
