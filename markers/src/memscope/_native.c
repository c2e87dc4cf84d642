/*
 * memscope._native: the USDT probe sites that memscope-bpf attaches to, wrapped as CPython
 * functions.
 *
 * The cost budget drives the shape of every wrapper: with no tracer attached a call must cost
 * about one Python->C call. So each wrapper is METH_O/METH_NOARGS/METH_FASTCALL (no tuple or
 * dict for arguments), validates its arguments with checks that do not allocate, then reads its
 * probe's semaphore and returns at once when it is 0. Only when a tracer has raised the
 * semaphore (or a test hook is installed) does it go to a separate cold function that holds the
 * probe site itself, so the hot path stays a few instructions long.
 *
 * Arguments are validated on every call, traced or not, so that a script which runs untraced
 * cannot start raising once a tracer attaches. For an ASCII str (the usual label) CPython's
 * UTF-8 view is the str's own buffer, so validation is a length read plus a memchr over at most
 * 128 bytes; a non-ASCII str is encoded once and CPython caches the encoding on the object.
 *
 * The probe contract (provider "memscope"; argument order and types are what the tracer
 * decodes, see memscope-user/src/apis/markers.rs):
 *   tag_push(int64 level, char *label)     tag_pop(int64 level, char *label)
 *   addr_tag(uint64 addr, int64 level, char *label)
 *   step(int64 step)                       mark(char *msg)
 *   range_start(uint64 id, char *msg)      range_end(uint64 id)
 *   collect(int64 on)
 *   op_start(char *name)                   op_end(char *name)
 *   tensor_access(uint64 ptr, uint64 nbytes, int64 kind, char *desc)   kind 0 read, 1 write
 *
 * The operator probes (memscope.torch.trace_ops) carry text the framework makes, not the user:
 * an operator name ("aten.mm.default") and a tensor description ("float32[4,8]"). Those are
 * clipped to LABEL_MAX bytes on a UTF-8 character boundary instead of rejected, because a traced
 * operator must never raise over its own name.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "memscope_usdt.h"

/* msMemScope's label limit; the tracer copies at most this many bytes plus the NUL. */
#define LABEL_MAX 128
/* OwnerLevel: FRAMEWORK=0 .. USER_DEFINED_3=7. */
#define LEVEL_MIN 0
#define LEVEL_MAX 7
#define LEVEL_USER 5

/* ---- semaphores: one per probe, in .probes (see memscope_usdt.h for why there) ---- */
#define MEMSCOPE_PROBES(X)                                                                            \
    X(tag_push) X(tag_pop) X(addr_tag) X(step) X(mark) X(range_start) X(range_end) X(collect) X(op_start) X(op_end) \
    X(tensor_access)

#define DEFINE_SEMAPHORE(p) MEMSCOPE_USDT_SEMAPHORE(memscope_##p##_semaphore);
MEMSCOPE_PROBES(DEFINE_SEMAPHORE)

typedef struct {
    const char *name;
    volatile unsigned short *semaphore;
} probe_entry;

#define PROBE_ENTRY(p) {#p, &memscope_##p##_semaphore},
static const probe_entry probe_table[] = {MEMSCOPE_PROBES(PROBE_ENTRY)};
#define N_PROBES ((Py_ssize_t)(sizeof(probe_table) / sizeof(probe_table[0])))

/* Set by tests through _set_test_hook(); receives (probe name, args tuple) after the probe site
 * would have fired. Reading it on the fast path costs one load next to the semaphore's. */
static PyObject *test_hook = NULL;

/* Process-wide counters. Under the GIL a plain increment is atomic enough; a free-threaded
 * build needs a real atomic. */
static uint64_t step_counter = 0;
static uint64_t range_counter = 0;

static inline uint64_t next_value(uint64_t *counter) {
#ifdef Py_GIL_DISABLED
    return __atomic_add_fetch(counter, 1, __ATOMIC_RELAXED);
#else
    return ++*counter;
#endif
}

#define QUIET(p) __builtin_expect((memscope_##p##_semaphore | (test_hook != NULL)) == 0, 1)
#define COLD __attribute__((noinline, cold))

/* Calls the test hook, keeping it alive even if it uninstalls itself while running. */
static PyObject *call_hook(const char *format, ...) {
    PyObject *hook = test_hook;
    if (hook == NULL) {
        Py_RETURN_NONE;
    }
    va_list va;
    va_start(va, format);
    PyObject *call_args = Py_VaBuildValue(format, va);
    va_end(va);
    if (call_args == NULL) {
        return NULL;
    }
    Py_INCREF(hook);
    PyObject *result = PyObject_Call(hook, call_args, NULL);
    Py_DECREF(hook);
    Py_DECREF(call_args);
    if (result == NULL) {
        return NULL;
    }
    Py_DECREF(result);
    Py_RETURN_NONE;
}

/* ---- argument checks (no allocation for ASCII str and small ints) ---- */

/* A label or message as the NUL-terminated UTF-8 the probe passes (zero-copy). */
static inline int get_text(PyObject *obj, const char *what, int allow_empty, const char **out) {
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "memscope: the %s must be a str, not %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &n);
    if (s == NULL) {
        return -1;
    }
    if (n > LABEL_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "memscope: the %s is %zd bytes in UTF-8, over the limit of %d bytes (msMemScope's label "
                     "limit, and what the tracer copies); shorten it",
                     what, n, LABEL_MAX);
        return -1;
    }
    if (n == 0 && !allow_empty) {
        PyErr_Format(PyExc_ValueError, "memscope: the %s is empty; give it a name", what);
        return -1;
    }
    if (memchr(s, 0, (size_t)n) != NULL) {
        PyErr_Format(PyExc_ValueError,
                     "memscope: the %s contains a NUL character; the tracer reads it as a C string, so remove the NUL",
                     what);
        return -1;
    }
    *out = s;
    return 0;
}

static inline int get_level(PyObject *obj, long long *out) {
    long long v = PyLong_AsLongLong(obj); /* accepts int and anything with __index__ */
    if (v == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "memscope: the owner level must be an int (memscope.FRAMEWORK .. memscope.USER_DEFINED_3), "
                         "not %.100s",
                         Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    if (v < LEVEL_MIN || v > LEVEL_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "memscope: owner level %lld is out of range; use %d..%d (memscope.FRAMEWORK .. "
                     "memscope.USER_DEFINED_3)",
                     v, LEVEL_MIN, LEVEL_MAX);
        return -1;
    }
    *out = v;
    return 0;
}

/* A uint64 (address or range id); `what` names it in errors. */
static inline int get_u64(PyObject *obj, const char *what, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "memscope: the %s must be an int, not %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "memscope: the %s must be in 0..2**64-1", what);
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/*
 * (label, level=<default>) from a vectorcall, accepting `level` (and `label`) by keyword: these
 * functions are public as memscope.describe_label / memscope.undescribe.
 */
static int parse_label_level(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                             PyObject **label, PyObject **level) {
    *label = NULL;
    *level = NULL;
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "%s(label, level=USER) takes at most 2 arguments (%zd given)", fname, nargs);
        return -1;
    }
    if (nargs >= 1) {
        *label = args[0];
    }
    if (nargs == 2) {
        *level = args[1];
    }
    if (kwnames != NULL) {
        Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nkw; i++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, i);
            PyObject **slot;
            if (PyUnicode_CompareWithASCIIString(key, "label") == 0) {
                slot = label;
            } else if (PyUnicode_CompareWithASCIIString(key, "level") == 0) {
                slot = level;
            } else {
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, key);
                return -1;
            }
            if (*slot != NULL) {
                PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%U'", fname, key);
                return -1;
            }
            *slot = args[nargs + i];
        }
    }
    if (*label == NULL) {
        PyErr_Format(PyExc_TypeError, "%s() missing required argument 'label'", fname);
        return -1;
    }
    return 0;
}

/*
 * Framework text (an operator name, a tensor description) as the C string the probe passes: the
 * str's own UTF-8 buffer when it fits in LABEL_MAX bytes, else its longest prefix that ends on a
 * character boundary, copied into buf (LABEL_MAX + 1 bytes). An interior NUL ends the C string
 * early, which is all the tracer would read anyway. Only the traced path calls this, so a str
 * CPython cannot encode (lone surrogates) is sent as "?" rather than raising only while traced.
 */
static const char *framework_text(PyObject *obj, char *buf) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &n);
    if (s == NULL) {
        PyErr_Clear();
        return "?";
    }
    if (n <= LABEL_MAX) {
        return s;
    }
    Py_ssize_t k = LABEL_MAX;
    /* s[k] is the first byte cut off: while it continues a character, cut that character too. */
    while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) {
        k--;
    }
    memcpy(buf, s, (size_t)k);
    buf[k] = '\0';
    return buf;
}

/* ---- cold paths: the probe sites ---- */

COLD static PyObject *fire_tag_push(long long level, PyObject *label, const char *s) {
    if (memscope_tag_push_semaphore) {
        MEMSCOPE_USDT2(memscope, tag_push, memscope_tag_push_semaphore, S64, level, PTR, s);
    }
    return call_hook("s(LO)", "tag_push", level, label);
}

COLD static PyObject *fire_tag_pop(long long level, PyObject *label, const char *s) {
    if (memscope_tag_pop_semaphore) {
        MEMSCOPE_USDT2(memscope, tag_pop, memscope_tag_pop_semaphore, S64, level, PTR, s);
    }
    return call_hook("s(LO)", "tag_pop", level, label);
}

COLD static PyObject *fire_addr_tag(uint64_t addr, long long level, PyObject *label, const char *s) {
    if (memscope_addr_tag_semaphore) {
        MEMSCOPE_USDT3(memscope, addr_tag, memscope_addr_tag_semaphore, U64, addr, S64, level, PTR, s);
    }
    return call_hook("s(KLO)", "addr_tag", (unsigned long long)addr, level, label);
}

COLD static PyObject *fire_step(int64_t n) {
    if (memscope_step_semaphore) {
        MEMSCOPE_USDT1(memscope, step, memscope_step_semaphore, S64, n);
    }
    return call_hook("s(L)", "step", (long long)n);
}

COLD static PyObject *fire_mark(PyObject *msg, const char *s) {
    if (memscope_mark_semaphore) {
        MEMSCOPE_USDT1(memscope, mark, memscope_mark_semaphore, PTR, s);
    }
    return call_hook("s(O)", "mark", msg);
}

COLD static PyObject *fire_range_start(uint64_t id, PyObject *msg, const char *s) {
    if (memscope_range_start_semaphore) {
        MEMSCOPE_USDT2(memscope, range_start, memscope_range_start_semaphore, U64, id, PTR, s);
    }
    return call_hook("s(KO)", "range_start", (unsigned long long)id, msg);
}

COLD static PyObject *fire_range_end(uint64_t id) {
    if (memscope_range_end_semaphore) {
        MEMSCOPE_USDT1(memscope, range_end, memscope_range_end_semaphore, U64, id);
    }
    return call_hook("s(K)", "range_end", (unsigned long long)id);
}

COLD static PyObject *fire_collect(int64_t on) {
    if (memscope_collect_semaphore) {
        MEMSCOPE_USDT1(memscope, collect, memscope_collect_semaphore, S64, on);
    }
    return call_hook("s(L)", "collect", (long long)on);
}

COLD static PyObject *fire_op_start(PyObject *name) {
    char buf[LABEL_MAX + 1];
    const char *s = framework_text(name, buf);
    if (memscope_op_start_semaphore) {
        MEMSCOPE_USDT1(memscope, op_start, memscope_op_start_semaphore, PTR, s);
    }
    return call_hook("s(s)", "op_start", s);
}

COLD static PyObject *fire_op_end(PyObject *name) {
    char buf[LABEL_MAX + 1];
    const char *s = framework_text(name, buf);
    if (memscope_op_end_semaphore) {
        MEMSCOPE_USDT1(memscope, op_end, memscope_op_end_semaphore, PTR, s);
    }
    return call_hook("s(s)", "op_end", s);
}

COLD static PyObject *fire_tensor_access(uint64_t ptr, uint64_t nbytes, int64_t kind, PyObject *desc) {
    char buf[LABEL_MAX + 1];
    const char *s = framework_text(desc, buf);
    if (memscope_tensor_access_semaphore) {
        MEMSCOPE_USDT4(memscope, tensor_access, memscope_tensor_access_semaphore, U64, ptr, U64, nbytes, S64, kind,
                       PTR, s);
    }
    return call_hook("s(KKLs)", "tensor_access", (unsigned long long)ptr, (unsigned long long)nbytes,
                     (long long)kind, s);
}

/* ---- the Python-facing functions ---- */

static PyObject *tag_common(const char *fname, int push, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    PyObject *label, *level_obj;
    long long level = LEVEL_USER;
    const char *s;
    if (__builtin_expect(kwnames == NULL && (nargs == 1 || nargs == 2), 1)) {
        label = args[0];
        level_obj = nargs == 2 ? args[1] : NULL;
    } else if (parse_label_level(fname, args, nargs, kwnames, &label, &level_obj) < 0) {
        return NULL;
    }
    if (level_obj != NULL && get_level(level_obj, &level) < 0) {
        return NULL;
    }
    if (get_text(label, "label", 0, &s) < 0) {
        return NULL;
    }
    if (push) {
        if (QUIET(tag_push)) {
            Py_RETURN_NONE;
        }
        return fire_tag_push(level, label, s);
    }
    if (QUIET(tag_pop)) {
        Py_RETURN_NONE;
    }
    return fire_tag_pop(level, label, s);
}

static PyObject *py_tag_push(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return tag_common("tag_push", 1, args, nargs, kwnames);
}

static PyObject *py_tag_pop(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return tag_common("tag_pop", 0, args, nargs, kwnames);
}

static PyObject *py_addr_tag(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    uint64_t addr;
    long long level = LEVEL_USER;
    const char *s;
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "addr_tag(addr, label, level=USER_DEFINED_1) takes 2 or 3 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    if (get_u64(args[0], "address", &addr) < 0) {
        return NULL;
    }
    if (nargs == 3 && get_level(args[2], &level) < 0) {
        return NULL;
    }
    if (get_text(args[1], "label", 0, &s) < 0) {
        return NULL;
    }
    if (QUIET(addr_tag)) {
        Py_RETURN_NONE;
    }
    return fire_addr_tag(addr, level, args[1], s);
}

static PyObject *py_step(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    int64_t n = (int64_t)next_value(&step_counter);
    if (!QUIET(step)) {
        PyObject *r = fire_step(n);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    return PyLong_FromLongLong(n);
}

static PyObject *py_mark(PyObject *self, PyObject *msg) {
    (void)self;
    const char *s;
    if (get_text(msg, "message", 1, &s) < 0) {
        return NULL;
    }
    if (QUIET(mark)) {
        Py_RETURN_NONE;
    }
    return fire_mark(msg, s);
}

static PyObject *py_range_start(PyObject *self, PyObject *msg) {
    (void)self;
    const char *s;
    if (get_text(msg, "message", 1, &s) < 0) {
        return NULL;
    }
    uint64_t id = next_value(&range_counter);
    if (!QUIET(range_start)) {
        PyObject *r = fire_range_start(id, msg, s);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    return PyLong_FromUnsignedLongLong(id);
}

static PyObject *py_range_end(PyObject *self, PyObject *id_obj) {
    (void)self;
    uint64_t id;
    if (get_u64(id_obj, "range id", &id) < 0) {
        return NULL;
    }
    if (QUIET(range_end)) {
        Py_RETURN_NONE;
    }
    return fire_range_end(id);
}

static PyObject *py_collect(PyObject *self, PyObject *on_obj) {
    (void)self;
    int on = PyObject_IsTrue(on_obj);
    if (on < 0) {
        return NULL;
    }
    if (QUIET(collect)) {
        Py_RETURN_NONE;
    }
    return fire_collect(on);
}

static inline int check_op_name(PyObject *name) {
    if (__builtin_expect(PyUnicode_Check(name), 1)) {
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "memscope: the operator name must be a str, not %.100s", Py_TYPE(name)->tp_name);
    return -1;
}

static PyObject *py_op_start(PyObject *self, PyObject *name) {
    (void)self;
    if (check_op_name(name) < 0) {
        return NULL;
    }
    if (QUIET(op_start)) {
        Py_RETURN_NONE;
    }
    return fire_op_start(name);
}

static PyObject *py_op_end(PyObject *self, PyObject *name) {
    (void)self;
    if (check_op_name(name) < 0) {
        return NULL;
    }
    if (QUIET(op_end)) {
        Py_RETURN_NONE;
    }
    return fire_op_end(name);
}

static PyObject *py_tensor_access(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    uint64_t ptr, nbytes;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "tensor_access(ptr, nbytes, kind, desc) takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    if (get_u64(args[0], "address", &ptr) < 0 || get_u64(args[1], "size", &nbytes) < 0) {
        return NULL;
    }
    if (!PyLong_Check(args[2])) {
        PyErr_Format(PyExc_TypeError, "memscope: the access kind must be an int, not %.100s",
                     Py_TYPE(args[2])->tp_name);
        return NULL;
    }
    int overflow;
    long kind = PyLong_AsLongAndOverflow(args[2], &overflow); /* no error for an int, only the flag */
    if (overflow || (kind != 0 && kind != 1)) {
        PyErr_SetString(PyExc_ValueError, "memscope: the access kind must be 0 (read) or 1 (write)");
        return NULL;
    }
    if (!PyUnicode_Check(args[3])) {
        PyErr_Format(PyExc_TypeError, "memscope: the tensor description must be a str, not %.100s",
                     Py_TYPE(args[3])->tp_name);
        return NULL;
    }
    if (QUIET(tensor_access)) {
        Py_RETURN_NONE;
    }
    return fire_tensor_access(ptr, nbytes, (int64_t)kind, args[3]);
}

/* ---- introspection ---- */

static PyObject *py_semaphores(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *d = PyDict_New();
    if (d == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < N_PROBES; i++) {
        PyObject *v = PyLong_FromLong(*probe_table[i].semaphore);
        if (v == NULL || PyDict_SetItemString(d, probe_table[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *py_tracing(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    for (Py_ssize_t i = 0; i < N_PROBES; i++) {
        if (*probe_table[i].semaphore) {
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

static PyObject *py_enabled(PyObject *self, PyObject *name) {
    (void)self;
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "_enabled() wants a probe name (str), not %.100s", Py_TYPE(name)->tp_name);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < N_PROBES; i++) {
        if (PyUnicode_CompareWithASCIIString(name, probe_table[i].name) == 0) {
            return PyBool_FromLong(*probe_table[i].semaphore != 0 || test_hook != NULL);
        }
    }
    PyErr_Format(PyExc_ValueError, "no memscope probe named %R; the probes are memscope._native.PROBES", name);
    return NULL;
}

static PyObject *py_set_test_hook(PyObject *self, PyObject *hook) {
    (void)self;
    if (hook != Py_None && !PyCallable_Check(hook)) {
        PyErr_Format(PyExc_TypeError, "_set_test_hook() wants a callable(probe, args) or None, not %.100s",
                     Py_TYPE(hook)->tp_name);
        return NULL;
    }
    PyObject *old = test_hook;
    if (hook == Py_None) {
        test_hook = NULL;
    } else {
        Py_INCREF(hook);
        test_hook = hook;
    }
    if (old == NULL) {
        Py_RETURN_NONE;
    }
    return old; /* the reference we held becomes the caller's */
}

static PyObject *py_noop(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    Py_RETURN_NONE;
}

static PyMethodDef native_methods[] = {
    {"tag_push", (PyCFunction)(void (*)(void))py_tag_push, METH_FASTCALL | METH_KEYWORDS,
     "tag_push(label, level=5)\n--\n\n"
     "Push an owner label (probe memscope:tag_push(level, label)); pair with tag_pop."},
    {"tag_pop", (PyCFunction)(void (*)(void))py_tag_pop, METH_FASTCALL | METH_KEYWORDS,
     "tag_pop(label, level=5)\n--\n\n"
     "Pop an owner label pushed with tag_push (probe memscope:tag_pop(level, label))."},
    {"addr_tag", (PyCFunction)(void (*)(void))py_addr_tag, METH_FASTCALL,
     "addr_tag(addr, label, level=5, /)\n--\n\n"
     "Tag the memory block at addr (probe memscope:addr_tag(addr, level, label))."},
    {"step", py_step, METH_NOARGS,
     "step($module, /)\n--\n\n"
     "Advance the process-wide step counter and return it (first call: 1); probe memscope:step(step)."},
    {"mark", py_mark, METH_O, "mark($module, msg, /)\n--\n\nA point marker (probe memscope:mark(msg))."},
    {"range_start", py_range_start, METH_O,
     "range_start($module, msg, /)\n--\n\n"
     "Open a range and return its id (process-wide, from 1); probe memscope:range_start(id, msg)."},
    {"range_end", py_range_end, METH_O,
     "range_end($module, range_id, /)\n--\n\nClose a range (probe memscope:range_end(id))."},
    {"collect", py_collect, METH_O,
     "collect($module, on, /)\n--\n\nStart (true) or stop (false) collection (probe memscope:collect(on))."},
    {"op_start", py_op_start, METH_O,
     "op_start($module, name, /)\n--\n\n"
     "An operator begins (probe memscope:op_start(name)); names over 128 bytes are clipped, not rejected."},
    {"op_end", py_op_end, METH_O,
     "op_end($module, name, /)\n--\n\nAn operator ends (probe memscope:op_end(name)); pair with op_start."},
    {"tensor_access", (PyCFunction)(void (*)(void))py_tensor_access, METH_FASTCALL,
     "tensor_access($module, ptr, nbytes, kind, desc, /)\n--\n\n"
     "The current operator reads (kind 0) or writes (kind 1) nbytes at ptr; desc is dtype and shape "
     "(\"float32[4,8]\", clipped to 128 bytes). Probe memscope:tensor_access(ptr, nbytes, kind, desc)."},
    {"semaphores", py_semaphores, METH_NOARGS,
     "semaphores($module, /)\n--\n\n"
     "Probe name -> current semaphore value; a tracer raises it while the probe is attached."},
    {"tracing", py_tracing, METH_NOARGS, "tracing($module, /)\n--\n\nTrue when any probe's semaphore is raised."},
    {"_enabled", py_enabled, METH_O,
     "_enabled($module, probe, /)\n--\n\n"
     "True when calls of this probe go anywhere (semaphore raised or a test hook set): lets callers skip "
     "expensive argument gathering."},
    {"_set_test_hook", py_set_test_hook, METH_O,
     "_set_test_hook($module, hook, /)\n--\n\n"
     "Install hook(probe, args) called on every probe call (after the site), or None to remove it; "
     "returns the previous hook. For tests only."},
    {"_noop", py_noop, METH_NOARGS, "_noop($module, /)\n--\n\nDoes nothing: the bench's baseline C call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    "memscope._native",
    "USDT probe sites (provider 'memscope') for the memscope-bpf tracer.",
    -1,
    native_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) {
        return NULL;
    }
    PyObject *names = PyTuple_New(N_PROBES);
    if (names == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < N_PROBES; i++) {
        PyObject *s = PyUnicode_FromString(probe_table[i].name);
        if (s == NULL) {
            Py_DECREF(names);
            goto fail;
        }
        PyTuple_SET_ITEM(names, i, s);
    }
    if (PyModule_AddObject(m, "PROBES", names) < 0) {
        Py_DECREF(names);
        goto fail;
    }
    if (PyModule_AddStringConstant(m, "PROVIDER", "memscope") < 0 ||
        PyModule_AddIntConstant(m, "LABEL_MAX", LABEL_MAX) < 0 ||
        PyModule_AddObject(m, "PROBES_COMPILED", PyBool_FromLong(MEMSCOPE_USDT_SUPPORTED)) < 0) {
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
