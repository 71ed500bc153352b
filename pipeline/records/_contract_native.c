/*
 * The array passes of the trajectory contract in C: one call instead of a dozen numpy
 * calls of a microsecond each (pipeline/records/trajectory.py::find_violation, which is
 * the reference and the fallback; tests/unit/test_avro_native.py holds the two equal).
 *
 * scan(mask, logprobs, spans, roles, starts, ends, n_roles) -> None | (check, index)
 *
 * mask uint8, logprobs float32, roles uint8, starts and ends int32: 1-D arrays of the
 * dtypes find_violation has already checked; spans a sequence of (start, end, version)
 * tuples of ints. The answer is the first check that fails, in find_violation's order:
 *
 *   MASK      a loss_mask value other than 0 and 1
 *   LOGPROBS  a NaN or infinite log-probability
 *   SPAN      version span number `index` out of order, out of range or negative
 *   COVER     the spans do not cover every policy token
 *   ROLE      a role number with no role (index: the largest)
 *   TURN      turn number `index` out of order or outside [0, len(mask)]
 *
 * None means every check passed; NotImplemented means the input is not what the scan
 * reads (a strided array, a span that is not three ints): find_violation then checks it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { MASK = 1, LOGPROBS, SPAN, COVER, ROLE, TURN };

typedef struct {
    Py_buffer views[5];
    int held;
} Views;

/* a C-contiguous 1-D buffer of `itemsize`-byte items, or 0 (no error) when it is not */
static int
view(Views *v, PyObject *o, Py_ssize_t itemsize, Py_ssize_t *count)
{
    Py_buffer *b = &v->views[v->held];
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    v->held++;
    if (b->ndim != 1 || b->itemsize != itemsize)
        return 0;
    *count = b->shape[0];
    return 1;
}

static void
release(Views *v)
{
    while (v->held > 0)
        PyBuffer_Release(&v->views[--v->held]);
}

static int32_t
load_i32(const char *base, Py_ssize_t i)
{
    int32_t x;
    memcpy(&x, base + 4 * i, 4);
    return x;
}

static PyObject *
answer(int check, Py_ssize_t index)
{
    return Py_BuildValue("(in)", check, index);
}

static int
span_of(PyObject *s, long long out[3])
{
    if (!PyTuple_Check(s) || PyTuple_GET_SIZE(s) != 3)
        return 0;
    for (int k = 0; k < 3; k++) {
        PyObject *x = PyTuple_GET_ITEM(s, k);
        if (!PyLong_CheckExact(x))
            return 0;
        int overflow;
        out[k] = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (overflow || (out[k] == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

static PyObject *
scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "scan(mask, logprobs, spans, roles, starts, ends, n_roles)");
        return NULL;
    }
    long n_roles = PyLong_AsLong(args[6]);
    if (n_roles == -1 && PyErr_Occurred())
        return NULL;
    Views v = {.held = 0};
    Py_ssize_t n, n_logprobs, n_turns, n_starts, n_ends;
    if (!view(&v, args[0], 1, &n) || !view(&v, args[1], 4, &n_logprobs)
        || !view(&v, args[3], 1, &n_turns) || !view(&v, args[4], 4, &n_starts)
        || !view(&v, args[5], 4, &n_ends) || n_logprobs != n || n_starts != n_turns
        || n_ends != n_turns) {
        release(&v);
        Py_RETURN_NOTIMPLEMENTED;
    }
    /* arrays read from a record lie at any offset: 4-byte items are loaded by memcpy */
    const uint8_t *mask = v.views[0].buf;
    const char *logprobs = v.views[1].buf;
    const uint8_t *roles = v.views[2].buf;
    const char *starts = v.views[3].buf;
    const char *ends = v.views[4].buf;
    PyObject *result = NULL;

    /* branch-free passes, which the compiler vectorises */
    uint8_t high = 0;
    long long policy = 0;
    for (Py_ssize_t at = 0; at < n; at += 1 << 20) { /* chunks a uint32 sum cannot overflow */
        Py_ssize_t end = n - at < (1 << 20) ? n : at + (1 << 20);
        uint32_t chunk = 0;
        for (Py_ssize_t i = at; i < end; i++) {
            high |= mask[i];
            chunk += mask[i];
        }
        policy += chunk;
    }
    if (high > 1) {
        result = answer(MASK, 0);
        goto done;
    }
    uint32_t special = 0; /* an exponent of all ones: infinity or NaN */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, logprobs + 4 * i, 4);
        special |= ((bits & 0x7F800000u) == 0x7F800000u);
    }
    if (special) {
        result = answer(LOGPROBS, 0);
        goto done;
    }
    PyObject *spans = PySequence_Fast(args[2], "spans must be a sequence");
    if (spans == NULL)
        goto done;
    long long covered = 0, prev_end = 0, span[3];
    Py_ssize_t n_spans = PySequence_Fast_GET_SIZE(spans);
    for (Py_ssize_t k = 0; k < n_spans; k++) {
        if (!span_of(PySequence_Fast_GET_ITEM(spans, k), span)) {
            Py_DECREF(spans);
            result = Py_NewRef(Py_NotImplemented);
            goto done;
        }
        if (!(prev_end <= span[0] && span[0] < span[1] && span[1] <= n) || span[2] < 0) {
            Py_DECREF(spans);
            result = answer(SPAN, k);
            goto done;
        }
        for (long long i = span[0]; i < span[1]; i++)
            covered += mask[i];
        prev_end = span[1];
    }
    Py_DECREF(spans);
    if (covered != policy) {
        result = answer(COVER, 0);
        goto done;
    }
    uint8_t top = 0;
    for (Py_ssize_t i = 0; i < n_turns; i++)
        top = roles[i] > top ? roles[i] : top;
    if (n_turns && top >= n_roles) {
        result = answer(ROLE, top);
        goto done;
    }
    prev_end = 0;
    for (Py_ssize_t i = 0; i < n_turns; i++) {
        int32_t start = load_i32(starts, i), end = load_i32(ends, i);
        if (!(prev_end <= start && start <= end && end <= n)) {
            result = answer(TURN, i);
            goto done;
        }
        prev_end = end;
    }
    result = Py_NewRef(Py_None);
done:
    release(&v);
    return result;
}

static PyMethodDef module_methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(mask, logprobs, spans, roles, starts, ends, n_roles) -> None | (check, index)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pipeline.records._contract_native",
    .m_doc = "The trajectory contract's array passes in C (trajectory.find_violation is the "
             "reference)",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__contract_native(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "MASK", MASK) < 0
        || PyModule_AddIntConstant(m, "LOGPROBS", LOGPROBS) < 0
        || PyModule_AddIntConstant(m, "SPAN", SPAN) < 0
        || PyModule_AddIntConstant(m, "COVER", COVER) < 0
        || PyModule_AddIntConstant(m, "ROLE", ROLE) < 0
        || PyModule_AddIntConstant(m, "TURN", TURN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
