"""memscope.torch: automatic owner tags for a PyTorch model and optimizer (msMemScope's
``optimizer_step_hook`` and the activation/backward stage taggers, done with torch's public hooks).

torch is imported only inside the functions, so ``import memscope`` and even
``import memscope.torch`` never pull it in; a script without torch can import everything.

What gets tagged, and why this way:

* weights, gradients and optimizer state are tagged by address (probe ``addr_tag``) at
  ``DETAIL_1``; the tracer attributes the block that contains the address. They are re-tagged
  after every ``optimizer.step()`` because gradients and lazily created state (Adam's moments
  appear at the first step) get new blocks over time, and because a tracer that attaches late
  then learns about the long-lived blocks at the next step.
* a tensor is tagged when it has storage with a non-zero size: zero-element tensors and
  storage-less tensors (meta, fake) are skipped, 0-dim tensors such as Adam's ``step`` are
  tagged (they are real blocks; on an accelerator ``step`` may live on the host, which the tracer
  then attributes under host memory), non-tensor state (python ints) is skipped. A DTensor is
  followed to its local shard (``_local_tensor``). Each storage is tagged once per pass, with the
  first of weight / gradient / optimizer_state that reaches it.
* the forward of the top model is a span ``("activation", PROCESS)``: pushed by a forward
  pre-hook, popped by a forward hook registered with ``always_call=True`` so the pop happens
  even when forward raises.
* the backward of the top model is a span ``("backward", PROCESS)``: pushed by a full backward
  pre-hook (when the gradient of the model's output is ready, i.e. backward enters the model) and
  popped by an autograd final callback queued from that hook, which runs when the whole backward
  pass ends. A full backward *hook* is not used for the pop: when no model input requires grad
  (the usual case: data batches) torch fires it right after the pre-hook, before any of the
  model's own backward ran, and warns about it. If a backward pass fails before its final
  callback ran, the span is closed at the next forward.

The label stacks the tracer keeps are per thread. On CPU the backward runs on the thread that
called ``backward()``; on an accelerator autograd may run it on a device thread, in which case the
backward span is pushed and popped on that thread.

Operators (:func:`trace_ops`), as msMemScope's aten collection does it (a ``TorchDispatchMode``),
so the tracer can write ``OP_LAUNCH`` rows and ``ACCESS`` rows for the inefficient-memory
analyses, which count uses of a block in operators. Per operator, on the thread that runs it:

* ``op_start(str(func))`` (``aten.mm.default``), then one ``tensor_access`` READ per input tensor,
  the operator itself, one WRITE per mutated input (after the operator: an ``out=`` tensor may
  have been resized onto new storage), one WRITE per output tensor, and ``op_end`` (also when the
  operator raises, so the tracer's per-thread operator stack stays balanced).
* which inputs and outputs count comes from the operator's schema, with msMemScope's rules:
  an argument annotated as written (``Tensor(a!)``: in-place ``self``, ``out=``) is a WRITE; one
  annotated as an alias without a write (``Tensor(a)``: views) is not an access at all, nor is a
  return annotated as an alias (a view, or the in-place result already counted as a WRITE);
  factory operators (``new_*``, ``*_like``) only read their inputs' metadata, so those inputs are
  not accesses; the outputs of ``empty``-family operators are allocated, not written, so they are
  not accesses either (msMemScope exempts ``empty_like`` for the same reason).
* a tensor is sent as ``tensor.data_ptr()`` (where its elements start, inside the storage's
  block; the tracer resolves it to that block) and ``tensor.nbytes`` (elements x item size: the
  bytes this tensor covers, as msMemScope's ``tensor_size``), with ``"<dtype>[d0,d1,...]"``
  (``float32[4,8]``) as its description. Tensors with no elements or no readable data pointer
  (meta, fake, sparse) are skipped: they touch no block.

A ``TorchDispatchMode`` sends every operator of the thread through Python, so ``trace_ops()``
costs microseconds per operator even untraced; the probes themselves are checked once per
operator (``op_start``'s semaphore) and nothing else is computed while no tracer listens. Only
eager operators are seen: a compiled graph runs its kernels without dispatching each aten op.
"""

from . import DETAIL_1, PROCESS, _native

__all__ = ["auto_tag", "AutoTagHandle", "tag_tensors", "tag_optimizer", "storage_bytes", "trace_ops"]

_addr_tag = _native.addr_tag
_push = _native.tag_push
_pop = _native.tag_pop


def _in_backward():
    import torch

    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _local(t):
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def _storage_of(t):
    """(data_ptr, nbytes) of the storage behind tensor ``t``, or None if it has nothing to tag."""
    t = _local(t)
    try:
        if t.numel() == 0:
            return None
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None  # meta / fake / other storage-less tensors
    if not ptr or not nbytes:
        return None
    return ptr, nbytes


def tag_tensors(tensors, label, level=DETAIL_1, seen=None):
    """Tag every tensor in ``tensors`` (non-tensors are skipped) with ``(label, level)`` by the
    address of its storage; storages already in ``seen`` (a set of data_ptrs, updated) are
    skipped. Returns the number of tags sent."""
    import torch

    sent = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = _storage_of(t)
        if s is None or (seen is not None and s[0] in seen):
            continue
        if seen is not None:
            seen.add(s[0])
        _addr_tag(s[0], label, level)
        sent += 1
    return sent


def storage_bytes(tensors):
    """Bytes of the distinct storages behind ``tensors`` (by data_ptr; DTensor: local shard).

    This is what tagging these tensors can attribute at most, so tests use it as ground truth."""
    import torch

    total = 0
    seen = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = _storage_of(t)
        if s is None or s[0] in seen:
            continue
        seen.add(s[0])
        total += s[1]
    return total


def _optimizer_tensors(optimizer):
    """(weights, gradients, states) reachable from ``optimizer``'s param groups."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params if getattr(p, "grad", None) is not None]
    states = []
    for p in params:
        st = optimizer.state.get(p)
        if st:
            states.extend(st.values())
    return params, grads, states


def tag_optimizer(optimizer, level=DETAIL_1):
    """Tag the optimizer's params (``weight``), their grads (``gradient``) and its per-param state
    tensors (``optimizer_state``). Skipped entirely when no tracer listens."""
    if not _native._enabled("addr_tag"):
        return 0
    params, grads, states = _optimizer_tensors(optimizer)
    seen = set()
    return (tag_tensors(params, "weight", level, seen) + tag_tensors(grads, "gradient", level, seen)
            + tag_tensors(states, "optimizer_state", level, seen))


class AutoTagHandle:
    """What :func:`auto_tag` installed; ``remove()`` takes every hook out again (also on ``with`` exit)."""

    __slots__ = ("_handles", "_backward_open", "__weakref__")

    def __init__(self):
        self._handles = []
        # Backward spans pushed whose final callback has not run yet.
        self._backward_open = 0

    def remove(self):
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.remove()

    # -- hooks --

    def _forward_pre(self, module, args):
        if self._backward_open and not _in_backward():
            # A backward pass failed before its final callback ran: close its span now. (A forward
            # inside backward, e.g. activation-checkpoint recomputation, must not close it.)
            while self._backward_open:
                self._backward_open -= 1
                _pop("backward", PROCESS)
        _push("activation", PROCESS)

    def _forward_post(self, module, args, output):
        _pop("activation", PROCESS)

    def _backward_pre(self, module, grad_output):
        import torch

        _push("backward", PROCESS)
        self._backward_open += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self):
        if self._backward_open:
            self._backward_open -= 1
            _pop("backward", PROCESS)

    def _optimizer_post(self, optimizer, args, kwargs):
        tag_optimizer(optimizer)


def auto_tag(model, optimizer=None):
    """Tag ``model``'s memory automatically; returns an :class:`AutoTagHandle`.

    Tags every parameter now (``weight``, DETAIL_1), and installs hooks: forward spans
    (``activation``, PROCESS), backward spans (``backward``, PROCESS) and, with ``optimizer``, a
    step post-hook that re-tags weights, gradients and optimizer state (DETAIL_1). See the module
    docstring for the rules.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"memscope.torch.auto_tag() wants a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not hasattr(optimizer, "register_step_post_hook"):
        raise TypeError(f"memscope.torch.auto_tag(): optimizer {type(optimizer).__name__} has no "
                        "register_step_post_hook (a torch.optim.Optimizer has, since torch 2.0)")
    handle = AutoTagHandle()
    h = handle._handles
    h.append(model.register_forward_pre_hook(handle._forward_pre))
    try:
        h.append(model.register_forward_hook(handle._forward_post, always_call=True))
    except TypeError:  # torch < 2.1: no always_call, so a forward that raises leaves its span open
        h.append(model.register_forward_hook(handle._forward_post))
    h.append(model.register_full_backward_pre_hook(handle._backward_pre))
    if optimizer is not None:
        h.append(optimizer.register_step_post_hook(handle._optimizer_post))
    if _native._enabled("addr_tag"):
        seen = set()
        tag_tensors(model.parameters(), "weight", DETAIL_1, seen)
        if optimizer is not None:
            params, grads, states = _optimizer_tensors(optimizer)
            tag_tensors(params, "weight", DETAIL_1, seen)
            tag_tensors(grads, "gradient", DETAIL_1, seen)
            tag_tensors(states, "optimizer_state", DETAIL_1, seen)
    return handle



# ---- operators: trace_ops ----

_READ = 0
_WRITE = 1
_op_start = _native.op_start
_op_end = _native.op_end
_tensor_access = _native.tensor_access
_enabled = _native._enabled


class _OpPlan:
    """What one operator's schema says about its tensors, worked out once per operator."""

    __slots__ = ("name", "roles", "by_name", "returns")

    def __init__(self, func):
        self.name = str(func)
        schema = getattr(func, "_schema", None)
        if schema is None:  # not an operator overload: name it, but claim no accesses
            self.roles, self.by_name, self.returns = (), {}, ()
            return
        base = schema.name.split("::")[-1]
        factory = base.startswith("new_") or base.endswith("_like")
        roles = []
        for a in schema.arguments:
            info = a.alias_info
            if info is not None and info.is_write:
                roles.append(_WRITE)
            elif info is not None or factory:
                roles.append(None)  # a view's input, or a factory's template: metadata only
            else:
                roles.append(_READ)
        self.roles = tuple(roles)
        self.by_name = {a.name: r for a, r in zip(schema.arguments, roles)}
        fresh = "empty" not in base
        self.returns = tuple(fresh and r.alias_info is None for r in schema.returns)


_plans = {}
_dtype_names = {}


def _plan(func):
    p = _plans.get(func)
    if p is None:
        p = _plans[func] = _OpPlan(func)
    return p


def _tensors(value, out):
    import torch

    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)


def _send(tensors, kind):
    for t in tensors:
        try:
            nbytes = t.nbytes
            ptr = t.data_ptr() if nbytes else 0
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            continue  # no storage to point at: meta, fake, sparse, ...
        if not ptr:
            continue
        dtype = t.dtype
        name = _dtype_names.get(dtype)
        if name is None:
            name = _dtype_names[dtype] = str(dtype).rpartition(".")[2]
        _tensor_access(ptr, nbytes, kind, name + "[" + ",".join([str(d) for d in t.shape]) + "]")


_mode_class = None


def _ops_mode():
    global _mode_class
    if _mode_class is not None:
        return _mode_class
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpsMode(TorchDispatchMode):
        """memscope.torch.trace_ops(): see the module docstring."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if kwargs is None:
                kwargs = {}
            if not _enabled("op_start"):
                return func(*args, **kwargs)
            plan = _plans.get(func) or _plan(func)
            name = plan.name
            _op_start(name)
            try:
                if not _enabled("tensor_access"):
                    return func(*args, **kwargs)
                reads, writes = [], []
                roles = plan.roles
                for i, value in enumerate(args):
                    role = roles[i] if i < len(roles) else None
                    if role is not None:
                        _tensors(value, reads if role == _READ else writes)
                for key, value in kwargs.items():
                    role = plan.by_name.get(key)
                    if role is not None:
                        _tensors(value, reads if role == _READ else writes)
                _send(reads, _READ)
                out = func(*args, **kwargs)
                written = writes
                returns = plan.returns
                if len(returns) == 1:
                    if returns[0]:
                        _tensors(out, written)
                elif isinstance(out, (list, tuple)):
                    for fresh, value in zip(returns, out):
                        if fresh:
                            _tensors(value, written)
                _send(written, _WRITE)
                return out
            finally:
                _op_end(name)

    _mode_class = OpsMode
    return OpsMode


def trace_ops():
    """A context manager that reports every operator the current thread runs (and the backward
    autograd runs for it) to the tracer: ``op_start``/``op_end`` around each, and a
    ``tensor_access`` read or write per tensor it uses. See the module docstring for the rules.

    ``with memscope.torch.trace_ops(): loss = model(x).sum(); loss.backward()``

    Nothing is sent while no tracer listens, but the dispatch mode still routes each operator
    through Python (microseconds per operator): enter it around the code to analyse.
    """
    return _ops_mode()()
