"""memscope: markers for the memscope-bpf tracer, called from training and inference scripts.

Each marker is a USDT probe site in the native extension ``memscope._native``; ``memscope-bpf
trace --pid N`` attaches uprobes to those sites and attributes memory to the labels, steps and
ranges they carry. With no tracer attached a marker costs about one Python->C call, so they
can stay in production code. That is why the hot entry points below are the native functions
themselves (no Python wrapper frame) and the context-manager objects use ``__slots__``.

This module must not import torch (scripts that never use torch pay nothing for it); the
torch helpers live in ``memscope.torch`` and import torch only inside their functions.
"""

import functools as _functools
import time as _time

from . import _native

__all__ = [
    "FRAMEWORK", "COMPONENT", "PROCESS", "DETAIL_1", "DETAIL_2",
    "USER_DEFINED_1", "USER_DEFINED_2", "USER_DEFINED_3", "USER", "LEVEL_NAMES", "LABEL_MAX", "PROBES",
    "describe", "Describer", "describe_label", "undescribe", "addr_of",
    "step", "mark", "range_start", "range_end", "range", "start", "stop",
    "tracing", "semaphores", "wait_for_tracer",
]

# Owner levels, as msMemScope's OwnerLevel (csrc/analysis/event.h): memory is attributed to the
# newest label of each level; user labels fill USER_DEFINED_1..3 in stack order (the tracer does
# that assignment, so user spans are always sent as USER).
FRAMEWORK = 0
COMPONENT = 1
PROCESS = 2
DETAIL_1 = 3
DETAIL_2 = 4
USER_DEFINED_1 = 5
USER_DEFINED_2 = 6
USER_DEFINED_3 = 7
USER = USER_DEFINED_1
LEVEL_NAMES = ("FRAMEWORK", "COMPONENT", "PROCESS", "DETAIL_1", "DETAIL_2",
               "USER_DEFINED_1", "USER_DEFINED_2", "USER_DEFINED_3")

LABEL_MAX = _native.LABEL_MAX
PROBES = _native.PROBES

# The untraced path is the native call itself.
step = _native.step
mark = _native.mark
range_start = _native.range_start
range_end = _native.range_end
describe_label = _native.tag_push
undescribe = _native.tag_pop
tracing = _native.tracing
semaphores = _native.semaphores

_push = _native.tag_push
_pop = _native.tag_pop
_addr_tag = _native.addr_tag
_collect = _native.collect


def start():
    """Start collection (probe ``collect(1)``), as msMemScope's ``start()``."""
    _collect(1)


def stop():
    """Stop collection (probe ``collect(0)``), as msMemScope's ``stop()``."""
    _collect(0)


class Describer:
    """An owner label span: a context manager, a decorator, or explicit ``start()``/``stop()``.

    It holds no state besides the label and level (both read-only), so one instance can be
    entered several times at once (recursion, threads) and :func:`describe` can hand out the same
    instance for the same label: every enter pushes and every exit pops, and the tracer keeps the
    per-thread stacks and reference counts.
    """

    __slots__ = ("_label", "_level")

    def __init__(self, label, level=USER):
        self._label = label
        self._level = level

    @property
    def label(self):
        return self._label

    @property
    def level(self):
        return self._level

    def __enter__(self):
        _push(self._label, self._level)
        return self

    def __exit__(self, exc_type, exc, tb):
        _pop(self._label, self._level)

    def start(self):
        """Push the label; pair with :meth:`stop`."""
        _push(self._label, self._level)
        return self

    def stop(self):
        """Pop the label pushed by :meth:`start`."""
        _pop(self._label, self._level)

    def __call__(self, func):
        """Decorate ``func`` so each call runs inside this label."""
        import inspect as _inspect  # here, not at module level: it is slow to import and rarely needed

        if _inspect.iscoroutinefunction(func) or _inspect.isgeneratorfunction(func) \
                or _inspect.isasyncgenfunction(func):
            raise TypeError(
                f"memscope.describe({self._label!r}) cannot decorate {func.__qualname__}: it is a coroutine or "
                "generator function, whose body runs after the call returns (and interleaves with other "
                "code on the same thread); use `with memscope.describe(...):` inside its body instead")
        if not callable(func):
            raise TypeError(f"memscope.describe({self._label!r}) decorates a callable, not {type(func).__name__}")
        # Validate now rather than at the first call, so a bad label fails where it is written.
        _check_label(self._label, self._level)
        label, level = self._label, self._level

        @_functools.wraps(func)
        def wrapper(*args, **kwargs):
            _push(label, level)
            try:
                return func(*args, **kwargs)
            finally:
                _pop(label, level)

        return wrapper

    def __eq__(self, other):
        if not isinstance(other, Describer):
            return NotImplemented
        return (self._label, self._level) == (other._label, other._level)

    def __hash__(self):
        return hash((self._label, self._level))

    def __repr__(self):
        return f"memscope.Describer({self._label!r}, level={self._level!r})"


# describe("label") returns a shared Describer per label, which saves building one per `with`
# (about a third of the cost of a `with memscope.describe(...)` block). Bounded so that labels
# made up on the fly (f"layer{i}") cannot grow it without limit.
_SPAN_CACHE_MAX = 4096
_spans = {}


def _span(label):
    d = _spans.get(label)
    if d is None:
        if len(_spans) >= _SPAN_CACHE_MAX:
            _spans.clear()
        d = _spans[label] = Describer(label, USER)
    return d


def _check_label(label, level):
    # The native checks, for the places that must validate without sending anything: a decorator
    # at definition time, an address tag with no address. Same rules and messages as _native.c.
    if not isinstance(label, str):
        raise TypeError(f"memscope: the label must be a str, not {type(label).__name__}")
    data = label.encode("utf-8")
    if len(data) > LABEL_MAX:
        raise ValueError(f"memscope: the label is {len(data)} bytes in UTF-8, over the limit of {LABEL_MAX} bytes "
                         "(msMemScope's label limit, and what the tracer copies); shorten it")
    if not data:
        raise ValueError("memscope: the label is empty; give it a name")
    if b"\0" in data:
        raise ValueError("memscope: the label contains a NUL character; the tracer reads it as a C string, "
                         "so remove the NUL")
    if not isinstance(level, int):
        raise TypeError("memscope: the owner level must be an int (memscope.FRAMEWORK .. memscope.USER_DEFINED_3), "
                        f"not {type(level).__name__}")
    if not FRAMEWORK <= level <= USER_DEFINED_3:
        raise ValueError(f"memscope: owner level {level} is out of range; use {FRAMEWORK}..{USER_DEFINED_3} "
                         "(memscope.FRAMEWORK .. memscope.USER_DEFINED_3)")


def addr_of(obj):
    """The address a tag for ``obj`` should carry: an int as is; for a tensor-like object the
    start of its storage (``untyped_storage().data_ptr()``, else ``data_ptr()``), following a
    DTensor to its local shard (``_local_tensor``). Duck-typed, so torch is never imported."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return obj
    local = getattr(obj, "_local_tensor", None)
    if local is not None:
        obj = local
    storage = getattr(obj, "untyped_storage", None)
    if storage is not None:
        return storage().data_ptr()
    data_ptr = getattr(obj, "data_ptr", None)
    if data_ptr is not None:
        return data_ptr()
    raise TypeError(f"memscope: cannot tag a {type(obj).__name__}: pass an int address or a tensor "
                    "(an object with untyped_storage() or data_ptr())")


def describe(target=None, owner=None, level=None):
    """Label memory with an owner, in one of two ways.

    ``describe("label")`` or ``describe(owner="label")`` returns a :class:`Describer` span
    (level default ``USER``): use it as ``with``, as a decorator, or with ``.start()``/``.stop()``.
    Memory allocated inside the span is attributed to the label.

    ``describe(tensor_or_addr, owner="label", level=USER_DEFINED_1)`` tags an existing block
    right away (probe ``addr_tag``) and returns None. A tensor is reduced to its storage's
    address (see :func:`addr_of`); a zero address (an empty tensor) has nothing to tag and is
    skipped.
    """
    kind = type(target)
    if kind is str:
        if owner is not None:
            raise TypeError("memscope.describe(): got a label both as the first argument and as owner=; "
                            "pass describe('label') for a span, or describe(tensor, owner='label') to tag memory")
        if level is None:
            d = _spans.get(target)  # inlined hit path of _span(): one Python call less per `with`
            return d if d is not None else _span(target)
        return Describer(target, level)
    if target is None:
        if owner is None:
            raise TypeError("memscope.describe() needs a label: describe('label'), describe(owner='label'), "
                            "or describe(tensor, owner='label')")
        return _span(owner) if level is None and type(owner) is str else Describer(owner, USER if level is None
                                                                                     else level)
    if owner is None:
        raise TypeError(f"memscope.describe(): tagging a {kind.__name__} needs owner='label'")
    addr = target if kind is int else addr_of(target)
    if level is None:
        level = USER_DEFINED_1
    if addr:
        _addr_tag(addr, owner, level)
    else:
        # Still validate, so a bad label fails the same way whether or not the tensor is empty.
        _check_label(owner, level)
    return None


class range:  # noqa: A001 - deliberately memscope.range, shadowing the builtin only in this namespace
    """``with memscope.range("msg") as range_id:`` brackets a region with range_start/range_end."""

    __slots__ = ("msg", "id")

    def __init__(self, msg):
        self.msg = msg
        self.id = None

    def __enter__(self):
        self.id = range_start(self.msg)
        return self.id

    def __exit__(self, exc_type, exc, tb):
        range_end(self.id)


def wait_for_tracer(timeout=10.0, poll=0.01, probes=None):
    """Wait until a tracer has attached; True if it did within ``timeout`` seconds.

    It polls the probes' semaphores, which the tracer raises when it attaches. By default it
    waits for *every* probe (``memscope.PROBES``): a tracer attaches them one after another, so
    waiting for the first one could let the next marker fire before its own probe is live. Pass
    ``probes=("step",)`` (any iterable of names) to wait for fewer. ``timeout=None`` waits forever.
    """
    names = PROBES if probes is None else tuple(probes)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        raise ValueError(f"memscope.wait_for_tracer(): unknown probe(s) {unknown}; the probes are {PROBES}")
    deadline = None if timeout is None else _time.monotonic() + timeout
    while True:
        sems = semaphores()
        if all(sems[n] for n in names):
            return True
        if deadline is None:
            _time.sleep(poll)
            continue
        left = deadline - _time.monotonic()
        if left <= 0:
            return False
        _time.sleep(min(poll, left))


def __getattr__(name):
    # `memscope.torch` and `memscope.msmemscope` load on first use, so `import memscope` stays cheap
    # and never imports torch.
    if name in ("torch", "msmemscope"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'memscope' has no attribute {name!r}")
