/*
 * Avro binary encoding in C: the same writer and reader as the Python code that
 * pipeline/records/avro_binary.py generates, interpreted from a program of nodes.
 *
 * avro_binary.py builds the program (one node per type, records naming their fields'
 * nodes by index) and is the reference: for every input, valid or not, this module must
 * write the same bytes, read the same values and refuse with the same reason.
 * tests/unit/test_avro_native.py holds it to that.
 *
 * Reading is defensive like the Python reader: every length and count prefix is checked
 * against the bytes that are left, so no input allocates more than its own size.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum kind {
    K_NULL,
    K_BOOLEAN,
    K_INT,
    K_LONG,
    K_FLOAT,
    K_DOUBLE,
    K_STRING,
    K_BYTES,
    K_FIXED,
    K_ENUM,
    K_ARRAY,
    K_MAP,
    K_UNION,
    K_RECORD,
};

typedef struct {
    int kind;
    Py_ssize_t size;       /* fixed: bytes; enum: symbols; union: index of the null branch */
    Py_ssize_t child;      /* array items, map values, union's other branch */
    PyObject *name;        /* named types: full name */
    PyObject *symbols;     /* enum: tuple of str */
    PyObject *index;       /* enum: dict symbol -> int */
    Py_ssize_t nfields;    /* record */
    PyObject *names;       /* record: tuple of field names */
    Py_ssize_t *fields;    /* record: node of each field */
    PyObject *adapter;     /* record: obj -> field values, or NULL */
    PyObject *factory;     /* record: values -> obj, or NULL (a dict) */
    int factory_is_tuple;  /* factory is a tuple subclass (a NamedTuple) */
    /* record with the 1-D tensor path: */
    PyObject *dtypes;      /* tuple of numpy dtypes, in Dtype symbol order */
    PyObject *dtype_index; /* dict dtype -> int */
    Py_ssize_t *itemsize;  /* per dtype */
    PyObject *ndarray;     /* numpy.ndarray */
    PyObject *frombuffer;  /* numpy.frombuffer */
} Node;

typedef struct {
    PyObject_HEAD
    Py_ssize_t count;
    Node *nodes;
    Py_ssize_t top;
    Py_ssize_t size_hint; /* the last record's size: the next one's first allocation */
} Program;

static PyObject *DecodeError; /* pipeline.errors.RecordDecodeError */
static PyObject *str_dtype;

/* ---- errors ------------------------------------------------------------------------ */

static void *
refuse(const char *reason, PyObject *message)
{
    if (message != NULL) {
        PyObject *exc = PyObject_CallFunction(DecodeError, "sO", reason, message);
        Py_DECREF(message);
        if (exc != NULL) {
            PyErr_SetObject(DecodeError, exc);
            Py_DECREF(exc);
        }
    }
    return NULL;
}

#define REFUSE(reason, ...) refuse((reason), PyUnicode_FromFormat(__VA_ARGS__))

static void *
truncated(void)
{
    return REFUSE("truncated", "the bytes end before the record");
}

/* ---- writing ----------------------------------------------------------------------- */

typedef struct {
    PyObject *bytes;
    char *buf;
    Py_ssize_t len, cap;
} Out;

static int
reserve(Out *o, Py_ssize_t n)
{
    if (o->cap - o->len >= n)
        return 0;
    Py_ssize_t cap = o->cap * 2;
    if (cap - o->len < n)
        cap = o->len + n + 256;
    if (_PyBytes_Resize(&o->bytes, cap) < 0)
        return -1;
    o->buf = PyBytes_AS_STRING(o->bytes);
    o->cap = cap;
    return 0;
}

static int
put(Out *o, const void *data, Py_ssize_t n)
{
    if (reserve(o, n) < 0)
        return -1;
    memcpy(o->buf + o->len, data, (size_t)n);
    o->len += n;
    return 0;
}

static int
put_long(Out *o, long long n)
{
    if (reserve(o, 10) < 0)
        return -1;
    uint64_t z = ((uint64_t)n << 1) ^ (uint64_t)(n >> 63);
    unsigned char *p = (unsigned char *)o->buf + o->len;
    while (z >= 0x80) {
        *p++ = (unsigned char)((z & 0x7F) | 0x80);
        z >>= 7;
    }
    *p++ = (unsigned char)z;
    o->len = (char *)p - o->buf;
    return 0;
}

static int
as_long(PyObject *d, int is_int, long long *n)
{
    PyObject *i = PyNumber_Index(d);
    if (i == NULL)
        return -1;
    int overflow;
    *n = PyLong_AsLongLongAndOverflow(i, &overflow);
    if (*n == -1 && PyErr_Occurred()) {
        Py_DECREF(i);
        return -1;
    }
    if (overflow || (is_int && (*n < INT32_MIN || *n > INT32_MAX))) {
        PyErr_Format(PyExc_ValueError, "%S does not fit an Avro %s", i, is_int ? "int" : "long");
        Py_DECREF(i);
        return -1;
    }
    Py_DECREF(i);
    return 0;
}

static int put_value(Program *p, Node *node, PyObject *d, Out *o);

static int
put_bytes_like(Out *o, PyObject *d, Py_ssize_t fixed)
{
    if (PyUnicode_Check(d)) { /* a bytes default, code points 0-255 (Avro specification) */
        PyObject *b = PyUnicode_AsLatin1String(d);
        if (b == NULL)
            return -1;
        int r = put_bytes_like(o, b, fixed);
        Py_DECREF(b);
        return r;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(d, &view, PyBUF_SIMPLE) < 0)
        return -1;
    int r = -1;
    if (fixed >= 0) {
        if (view.len != fixed)
            PyErr_Format(PyExc_ValueError, "fixed needs %zd bytes, got %zd", fixed, view.len);
        else
            r = put(o, view.buf, view.len);
    }
    else if (put_long(o, view.len) == 0) {
        r = put(o, view.buf, view.len);
    }
    PyBuffer_Release(&view);
    return r;
}

/* The 1-D tensor path: 1 written, 0 declined (the generic writer takes it), -1 error. */
static int
put_tensor_1d(Node *node, PyObject *d, Out *o)
{
    if ((PyObject *)Py_TYPE(d) != node->ndarray)
        return 0;
    PyObject *dtype = PyObject_GetAttr(d, str_dtype);
    if (dtype == NULL)
        return -1;
    PyObject *found = PyDict_GetItemWithError(node->dtype_index, dtype);
    Py_DECREF(dtype);
    if (found == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long i = PyLong_AsLong(found);
    Py_buffer view;
    if (PyObject_GetBuffer(d, &view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* not contiguous, or a dtype numpy cannot export (bfloat16) */
        return 0;
    }
    if (view.ndim != 1) {
        PyBuffer_Release(&view);
        return 0;
    }
    int r = -1;
    if (reserve(o, 32) == 0) {
        unsigned char *q = (unsigned char *)o->buf + o->len;
        *q++ = (unsigned char)(i << 1);
        *q++ = 2; /* one block of one dimension */
        o->len = (char *)q - o->buf;
        if (put_long(o, view.shape[0]) == 0) {
            o->buf[o->len++] = 0;
            if (put_long(o, view.len) == 0)
                r = put(o, view.buf, view.len);
        }
    }
    PyBuffer_Release(&view);
    return r < 0 ? -1 : 1;
}

static int
put_record(Program *p, Node *node, PyObject *d, Out *o)
{
    if (node->ndarray != NULL) {
        int r = put_tensor_1d(node, d, o);
        if (r != 0)
            return r < 0 ? -1 : 0;
    }
    Py_ssize_t n = node->nfields;
    PyObject *values = NULL; /* a tuple of the field values, or NULL */
    if (node->adapter != NULL) {
        PyObject *v = PyObject_CallOneArg(node->adapter, d);
        if (v == NULL)
            return -1;
        values = PyTuple_Check(v) ? Py_NewRef(v) : PySequence_Tuple(v);
        Py_DECREF(v);
        if (values == NULL)
            return -1;
    }
    else if (PyTuple_Check(d)) {
        values = Py_NewRef(d);
    }
    if (values != NULL && PyTuple_GET_SIZE(values) != n) {
        PyErr_Format(PyExc_ValueError, "record %S has %zd fields, got %zd values", node->name, n,
                     PyTuple_GET_SIZE(values));
        Py_DECREF(values);
        return -1;
    }
    int r = 0;
    for (Py_ssize_t k = 0; k < n && r == 0; k++) {
        PyObject *name = PyTuple_GET_ITEM(node->names, k);
        PyObject *v;
        if (values != NULL) {
            v = Py_NewRef(PyTuple_GET_ITEM(values, k));
        }
        else if (PyDict_CheckExact(d)) {
            v = PyDict_GetItemWithError(d, name);
            if (v == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, name);
                r = -1;
                break;
            }
            Py_INCREF(v);
        }
        else {
            v = PyObject_GetAttr(d, name);
            if (v == NULL) {
                r = -1;
                break;
            }
        }
        r = put_value(p, &p->nodes[node->fields[k]], v, o);
        Py_DECREF(v);
    }
    Py_XDECREF(values);
    return r;
}

static int
put_value(Program *p, Node *node, PyObject *d, Out *o)
{
    long long n;
    switch (node->kind) {
    case K_NULL:
        if (d != Py_None) {
            PyErr_SetString(PyExc_TypeError, "null field given a value");
            return -1;
        }
        return 0;
    case K_BOOLEAN: {
        int t = PyObject_IsTrue(d);
        if (t < 0 || reserve(o, 1) < 0)
            return -1;
        o->buf[o->len++] = (char)t;
        return 0;
    }
    case K_INT:
    case K_LONG:
        if (as_long(d, node->kind == K_INT, &n) < 0)
            return -1;
        return put_long(o, n);
    case K_FLOAT:
    case K_DOUBLE: {
        double x = PyFloat_AsDouble(d);
        if (x == -1.0 && PyErr_Occurred())
            return -1;
        int size = node->kind == K_FLOAT ? 4 : 8;
        if (reserve(o, size) < 0)
            return -1;
        int r = size == 4 ? PyFloat_Pack4(x, o->buf + o->len, 1)
                          : PyFloat_Pack8(x, o->buf + o->len, 1);
        if (r < 0)
            return -1;
        o->len += size;
        return 0;
    }
    case K_STRING: {
        if (!PyUnicode_Check(d)) {
            PyErr_Format(PyExc_TypeError, "a string field given %.100s", Py_TYPE(d)->tp_name);
            return -1;
        }
        Py_ssize_t size;
        const char *s = PyUnicode_AsUTF8AndSize(d, &size);
        if (s == NULL || put_long(o, size) < 0)
            return -1;
        return put(o, s, size);
    }
    case K_BYTES:
        return put_bytes_like(o, d, -1);
    case K_FIXED:
        return put_bytes_like(o, d, node->size);
    case K_ENUM: {
        PyObject *i = PyDict_GetItemWithError(node->index, d);
        if (i == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%R is not a symbol of enum %S", d, node->name);
            return -1;
        }
        return put_long(o, PyLong_AsLongLong(i));
    }
    case K_ARRAY: {
        /* a tuple: writing an item may run Python code, which could change a list */
        PyObject *items = PyTuple_Check(d) ? Py_NewRef(d) : PySequence_Tuple(d);
        if (items == NULL)
            return -1;
        Py_ssize_t c = PyTuple_GET_SIZE(items);
        int r = 0;
        if (c) {
            r = put_long(o, c);
            Node *item = &p->nodes[node->child];
            for (Py_ssize_t k = 0; k < c && r == 0; k++)
                r = put_value(p, item, PyTuple_GET_ITEM(items, k), o);
        }
        Py_DECREF(items);
        return r < 0 ? -1 : put_long(o, 0);
    }
    case K_MAP: {
        PyObject *items = PyMapping_Items(d);
        if (items == NULL)
            return -1;
        Py_ssize_t c = PyList_GET_SIZE(items);
        int r = 0;
        if (c) {
            r = put_long(o, c);
            Node key = {.kind = K_STRING};
            Node *value = &p->nodes[node->child];
            for (Py_ssize_t k = 0; k < c && r == 0; k++) {
                PyObject *pair = PyList_GET_ITEM(items, k);
                if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                    PyErr_SetString(PyExc_TypeError, "a map's items must be pairs");
                    r = -1;
                    break;
                }
                r = put_value(p, &key, PyTuple_GET_ITEM(pair, 0), o);
                if (r == 0)
                    r = put_value(p, value, PyTuple_GET_ITEM(pair, 1), o);
            }
        }
        Py_DECREF(items);
        return r < 0 ? -1 : put_long(o, 0);
    }
    case K_UNION:
        if (d == Py_None)
            return put_long(o, node->size);
        if (put_long(o, 1 - node->size) < 0)
            return -1;
        return put_value(p, &p->nodes[node->child], d, o);
    case K_RECORD: {
        if (Py_EnterRecursiveCall(" while writing an Avro record"))
            return -1;
        int r = put_record(p, node, d, o);
        Py_LeaveRecursiveCall();
        return r;
    }
    }
    PyErr_SetString(PyExc_SystemError, "unknown Avro node");
    return -1;
}

/* ---- reading ----------------------------------------------------------------------- */

typedef struct {
    PyObject *obj; /* the bytes object read from */
    const unsigned char *buf;
    Py_ssize_t len, pos;
} In;

static int
get_long(In *in, long long *out)
{
    uint64_t n = 0;
    for (int shift = 0;; shift += 7) {
        if (shift > 63) {
            REFUSE("invalid", "variable-length integer longer than 10 bytes");
            return -1;
        }
        if (in->pos >= in->len) {
            truncated();
            return -1;
        }
        unsigned char b = in->buf[in->pos++];
        n |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            if (shift == 63 && (b & 0x7E)) { /* the tenth byte holds bit 63 alone */
                REFUSE("invalid", "variable-length integer beyond 64 bits");
                return -1;
            }
            break;
        }
    }
    *out = (long long)((n >> 1) ^ (~(n & 1) + 1));
    return 0;
}

static int
bad_length(const char *what, long long size, Py_ssize_t left)
{
    if (size < 0)
        REFUSE("bad_length", "negative %s length %lld", what, size);
    else
        REFUSE("bad_length", "%s length %lld exceeds the %zd bytes left", what, size, left);
    return -1;
}

static PyObject *get_value(Program *p, Node *node, In *in);

/* The 1-D tensor path: a read-only array over the input itself, or NULL with no error
   set for any other shape or encoding (the generic reader then reads and checks it).
   Step for step the Python reader's shortcut (codec's read_tensor_1d), errors included. */
static PyObject *
get_tensor_1d(Node *node, In *in)
{
    const unsigned char *b = in->buf;
    Py_ssize_t pos = in->pos, len = in->len;
    if (pos >= len)
        return truncated();
    unsigned code = b[pos];
    if ((code & 1) || code >= 2 * (unsigned)PyTuple_GET_SIZE(node->dtypes))
        return NULL;
    if (pos + 1 >= len)
        return truncated();
    if (b[pos + 1] != 2)
        return NULL;
    In at = *in;
    at.pos = pos + 2;
    long long dim, size;
    if (get_long(&at, &dim) < 0)
        return NULL;
    if (dim < 0)
        return NULL;
    if (at.pos >= len)
        return truncated();
    if (b[at.pos] != 0)
        return NULL;
    at.pos++;
    if (get_long(&at, &size) < 0)
        return NULL;
    Py_ssize_t itemsize = node->itemsize[code >> 1];
    if (dim > PY_SSIZE_T_MAX / 64 || size != dim * itemsize || size > len - at.pos)
        return NULL;
    PyObject *args[4];
    args[0] = in->obj;
    args[1] = PyTuple_GET_ITEM(node->dtypes, code >> 1);
    args[2] = PyLong_FromLongLong(dim);
    args[3] = PyLong_FromSsize_t(at.pos);
    PyObject *array = NULL;
    if (args[2] != NULL && args[3] != NULL)
        array = PyObject_Vectorcall(node->frombuffer, args, 4, NULL);
    Py_XDECREF(args[2]);
    Py_XDECREF(args[3]);
    if (array != NULL)
        in->pos = at.pos + size;
    else if (!PyErr_Occurred())
        PyErr_SetString(PyExc_SystemError, "frombuffer returned NULL");
    return array;
}

static PyObject *
get_record(Program *p, Node *node, In *in)
{
    if (node->ndarray != NULL) {
        PyObject *array = get_tensor_1d(node, in);
        if (array != NULL || PyErr_Occurred())
            return array;
    }
    Py_ssize_t n = node->nfields;
    PyObject *small[32];
    PyObject **values = n <= 32 ? small : PyMem_Malloc(sizeof(PyObject *) * (size_t)n);
    if (values == NULL)
        return PyErr_NoMemory();
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    for (; got < n; got++) {
        values[got] = get_value(p, &p->nodes[node->fields[got]], in);
        if (values[got] == NULL)
            goto done;
    }
    if (node->factory == NULL) {
        result = PyDict_New();
        for (Py_ssize_t k = 0; result != NULL && k < n; k++) {
            if (PyDict_SetItem(result, PyTuple_GET_ITEM(node->names, k), values[k]) < 0)
                Py_CLEAR(result);
        }
    }
    else if (node->factory_is_tuple) { /* tuple.__new__(cls, values): no Python __new__ */
        PyObject *t = PyTuple_New(n);
        if (t != NULL) {
            for (Py_ssize_t k = 0; k < n; k++)
                PyTuple_SET_ITEM(t, k, Py_NewRef(values[k]));
            PyObject *args = PyTuple_Pack(1, t);
            Py_DECREF(t);
            if (args != NULL) {
                result = PyTuple_Type.tp_new((PyTypeObject *)node->factory, args, NULL);
                Py_DECREF(args);
            }
        }
    }
    else {
        result = PyObject_Vectorcall(node->factory, values, (size_t)n, NULL);
    }
done:
    for (Py_ssize_t k = 0; k < got; k++)
        Py_DECREF(values[k]);
    if (values != small)
        PyMem_Free(values);
    return result;
}

static PyObject *
get_blocks(Program *p, Node *node, In *in)
{
    int is_map = node->kind == K_MAP;
    const char *what = is_map ? "map" : "array";
    PyObject *result = is_map ? PyDict_New() : PyList_New(0);
    if (result == NULL)
        return NULL;
    Node key = {.kind = K_STRING};
    Node *item = &p->nodes[node->child];
    for (;;) {
        long long c, skip;
        if (get_long(in, &c) < 0)
            goto fail;
        if (c < 0) {
            if (get_long(in, &skip) < 0)
                goto fail;
            if (c == LLONG_MIN) {
                REFUSE("bad_length", "%s length 9223372036854775808 exceeds the %zd bytes left",
                       what, in->len - in->pos);
                goto fail;
            }
            c = -c;
        }
        /* every item takes at least one byte: a larger count is corrupt */
        if (c > in->len - in->pos) {
            bad_length(what, c, in->len - in->pos);
            goto fail;
        }
        if (!c)
            return result;
        for (long long k = 0; k < c; k++) {
            if (is_map) {
                PyObject *name = get_value(p, &key, in);
                if (name == NULL)
                    goto fail;
                PyObject *value = get_value(p, item, in);
                int r = value == NULL ? -1 : PyDict_SetItem(result, name, value);
                Py_DECREF(name);
                Py_XDECREF(value);
                if (r < 0)
                    goto fail;
            }
            else {
                PyObject *value = get_value(p, item, in);
                int r = value == NULL ? -1 : PyList_Append(result, value);
                Py_XDECREF(value);
                if (r < 0)
                    goto fail;
            }
        }
    }
fail:
    Py_DECREF(result);
    return NULL;
}

static PyObject *
get_value(Program *p, Node *node, In *in)
{
    long long n;
    switch (node->kind) {
    case K_NULL:
        Py_RETURN_NONE;
    case K_BOOLEAN: {
        if (in->pos >= in->len)
            return truncated();
        unsigned char b = in->buf[in->pos++];
        if (b > 1)
            return REFUSE("invalid", "boolean byte %d", (int)b);
        return PyBool_FromLong(b);
    }
    case K_INT:
    case K_LONG:
        if (get_long(in, &n) < 0)
            return NULL;
        if (node->kind == K_INT && (n < INT32_MIN || n > INT32_MAX))
            return REFUSE("invalid", "%lld does not fit an Avro int", n);
        return PyLong_FromLongLong(n);
    case K_FLOAT:
    case K_DOUBLE: {
        int size = node->kind == K_FLOAT ? 4 : 8;
        if (in->len - in->pos < size)
            return REFUSE("truncated", "the bytes end inside a number");
        const char *at = (const char *)in->buf + in->pos;
        double x = size == 4 ? PyFloat_Unpack4(at, 1) : PyFloat_Unpack8(at, 1);
        if (x == -1.0 && PyErr_Occurred())
            return NULL;
        in->pos += size;
        return PyFloat_FromDouble(x);
    }
    case K_STRING:
    case K_BYTES: {
        if (get_long(in, &n) < 0)
            return NULL;
        Py_ssize_t left = in->len - in->pos;
        if (n < 0 || n > left) {
            bad_length(node->kind == K_STRING ? "string" : "bytes", n, left);
            return NULL;
        }
        const char *at = (const char *)in->buf + in->pos;
        in->pos += (Py_ssize_t)n;
        if (node->kind == K_BYTES)
            return PyBytes_FromStringAndSize(at, (Py_ssize_t)n);
        return PyUnicode_DecodeUTF8(at, (Py_ssize_t)n, "strict");
    }
    case K_FIXED: {
        if (in->len - in->pos < node->size)
            return truncated();
        PyObject *b = PyBytes_FromStringAndSize((const char *)in->buf + in->pos, node->size);
        in->pos += node->size;
        return b;
    }
    case K_ENUM:
        if (get_long(in, &n) < 0)
            return NULL;
        if (n < 0 || n >= node->size)
            return REFUSE("bad_enum", "%S has no symbol or branch number %lld", node->name, n);
        return Py_NewRef(PyTuple_GET_ITEM(node->symbols, (Py_ssize_t)n));
    case K_ARRAY:
    case K_MAP:
        return get_blocks(p, node, in);
    case K_UNION:
        if (get_long(in, &n) < 0)
            return NULL;
        if (n == node->size)
            Py_RETURN_NONE;
        if (n == 1 - node->size)
            return get_value(p, &p->nodes[node->child], in);
        return REFUSE("bad_enum", "union has no symbol or branch number %lld", n);
    case K_RECORD: {
        if (Py_EnterRecursiveCall(" while reading an Avro record"))
            return NULL;
        PyObject *r = get_record(p, node, in);
        Py_LeaveRecursiveCall();
        return r;
    }
    }
    PyErr_SetString(PyExc_SystemError, "unknown Avro node");
    return NULL;
}

/* ---- the Program type ------------------------------------------------------------ */

static void
clear_node(Node *node)
{
    Py_CLEAR(node->name);
    Py_CLEAR(node->symbols);
    Py_CLEAR(node->index);
    Py_CLEAR(node->names);
    Py_CLEAR(node->adapter);
    Py_CLEAR(node->factory);
    Py_CLEAR(node->dtypes);
    Py_CLEAR(node->dtype_index);
    Py_CLEAR(node->ndarray);
    Py_CLEAR(node->frombuffer);
    PyMem_Free(node->fields);
    node->fields = NULL;
    PyMem_Free(node->itemsize);
    node->itemsize = NULL;
}

static void
Program_dealloc(Program *self)
{
    for (Py_ssize_t k = 0; k < self->count; k++)
        clear_node(&self->nodes[k]);
    PyMem_Free(self->nodes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
opt(PyObject *o)
{
    return o == Py_None ? NULL : Py_NewRef(o);
}

static int
child_index(Program *self, PyObject *o, Py_ssize_t *out)
{
    Py_ssize_t i = PyLong_AsSsize_t(o);
    if (i == -1 && PyErr_Occurred())
        return -1;
    if (i < 0 || i >= self->count) {
        PyErr_Format(PyExc_ValueError, "node index %zd outside the program", i);
        return -1;
    }
    *out = i;
    return 0;
}

/* One node from its description, a tuple (kind, ...): see avro_binary.native_program. */
static int
init_node(Program *self, Node *node, PyObject *desc)
{
    if (!PyTuple_Check(desc) || PyTuple_GET_SIZE(desc) < 1) {
        PyErr_SetString(PyExc_TypeError, "a node is a tuple (kind, ...)");
        return -1;
    }
    Py_ssize_t size = PyTuple_GET_SIZE(desc);
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(desc, 0));
    if (kind == -1 && PyErr_Occurred())
        return -1;
    node->kind = (int)kind;
#define ARG(k) PyTuple_GET_ITEM(desc, (k))
#define NEED(n)                                                                              \
    if (size != (n)) {                                                                       \
        PyErr_Format(PyExc_ValueError, "node of kind %ld needs %d items", kind, (n));        \
        return -1;                                                                           \
    }
    switch (kind) {
    case K_NULL:
    case K_BOOLEAN:
    case K_INT:
    case K_LONG:
    case K_FLOAT:
    case K_DOUBLE:
    case K_STRING:
    case K_BYTES:
        NEED(1);
        return 0;
    case K_FIXED: /* (kind, name, size) */
        NEED(3);
        node->name = Py_NewRef(ARG(1));
        node->size = PyLong_AsSsize_t(ARG(2));
        return node->size < 0 ? -1 : 0;
    case K_ENUM: /* (kind, name, symbols, index) */
        NEED(4);
        if (!PyTuple_Check(ARG(2)) || !PyDict_Check(ARG(3))) {
            PyErr_SetString(PyExc_TypeError, "an enum node needs a tuple and a dict");
            return -1;
        }
        node->name = Py_NewRef(ARG(1));
        node->symbols = Py_NewRef(ARG(2));
        node->index = Py_NewRef(ARG(3));
        node->size = PyTuple_GET_SIZE(ARG(2));
        return 0;
    case K_ARRAY: /* (kind, child) */
    case K_MAP:
        NEED(2);
        return child_index(self, ARG(1), &node->child);
    case K_UNION: /* (kind, null branch, other child) */
        NEED(3);
        node->size = PyLong_AsSsize_t(ARG(1));
        if (node->size != 0 && node->size != 1) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "the null branch is 0 or 1");
            return -1;
        }
        return child_index(self, ARG(2), &node->child);
    case K_RECORD: { /* (kind, name, names, fields, adapter, factory, is_tuple, tensor) */
        NEED(8);
        PyObject *names = ARG(2), *fields = ARG(3), *tensor = ARG(7);
        if (!PyTuple_Check(names) || !PyTuple_Check(fields)
            || PyTuple_GET_SIZE(names) != PyTuple_GET_SIZE(fields)) {
            PyErr_SetString(PyExc_TypeError, "a record node needs names and fields alike");
            return -1;
        }
        node->name = Py_NewRef(ARG(1));
        node->names = Py_NewRef(names);
        node->nfields = PyTuple_GET_SIZE(fields);
        node->fields = PyMem_Calloc((size_t)node->nfields + 1, sizeof(Py_ssize_t));
        if (node->fields == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t k = 0; k < node->nfields; k++) {
            if (child_index(self, PyTuple_GET_ITEM(fields, k), &node->fields[k]) < 0)
                return -1;
        }
        node->adapter = opt(ARG(4));
        node->factory = opt(ARG(5));
        node->factory_is_tuple = PyObject_IsTrue(ARG(6));
        if (node->factory_is_tuple
            && (node->factory == NULL || !PyType_Check(node->factory)
                || !PyType_IsSubtype((PyTypeObject *)node->factory, &PyTuple_Type))) {
            PyErr_SetString(PyExc_TypeError, "a tuple factory must be a tuple subclass");
            return -1;
        }
        if (tensor == Py_None)
            return 0;
        /* (dtypes, dtype_index, itemsizes, ndarray, frombuffer) */
        if (!PyTuple_Check(tensor) || PyTuple_GET_SIZE(tensor) != 5
            || !PyTuple_Check(PyTuple_GET_ITEM(tensor, 0))
            || !PyDict_Check(PyTuple_GET_ITEM(tensor, 1))
            || !PyTuple_Check(PyTuple_GET_ITEM(tensor, 2))
            || PyTuple_GET_SIZE(PyTuple_GET_ITEM(tensor, 0))
                   != PyTuple_GET_SIZE(PyTuple_GET_ITEM(tensor, 2))
            || PyTuple_GET_SIZE(PyTuple_GET_ITEM(tensor, 0)) > 64) {
            PyErr_SetString(PyExc_TypeError, "a tensor spec is (dtypes, index, itemsizes, "
                                             "ndarray, frombuffer)");
            return -1;
        }
        node->dtypes = Py_NewRef(PyTuple_GET_ITEM(tensor, 0));
        node->dtype_index = Py_NewRef(PyTuple_GET_ITEM(tensor, 1));
        node->ndarray = Py_NewRef(PyTuple_GET_ITEM(tensor, 3));
        node->frombuffer = Py_NewRef(PyTuple_GET_ITEM(tensor, 4));
        Py_ssize_t count = PyTuple_GET_SIZE(node->dtypes);
        node->itemsize = PyMem_Calloc((size_t)count + 1, sizeof(Py_ssize_t));
        if (node->itemsize == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t k = 0; k < count; k++) {
            node->itemsize[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(PyTuple_GET_ITEM(tensor, 2), k));
            if (node->itemsize[k] <= 0) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "item sizes are positive");
                return -1;
            }
        }
        return 0;
    }
    }
#undef NEED
#undef ARG
    PyErr_Format(PyExc_ValueError, "unknown node kind %ld", kind);
    return -1;
}

static PyObject *
Program_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"nodes", "top", NULL};
    PyObject *nodes;
    Py_ssize_t top;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!n", keywords, &PyTuple_Type, &nodes, &top))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(nodes);
    if (top < 0 || top >= count) {
        PyErr_SetString(PyExc_ValueError, "top node outside the program");
        return NULL;
    }
    Program *self = (Program *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->nodes = PyMem_Calloc((size_t)count, sizeof(Node));
    if (self->nodes == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->count = count;
    self->top = top;
    self->size_hint = 256;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (init_node(self, &self->nodes[k], PyTuple_GET_ITEM(nodes, k)) < 0) {
            Py_DECREF(self);
            return NULL;
        }
    }
    return (PyObject *)self;
}

static PyObject *
Program_encode(Program *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "encode(datum, prefix: bytes)");
        return NULL;
    }
    Py_ssize_t plen = PyBytes_GET_SIZE(args[1]);
    Out o = {.len = plen, .cap = self->size_hint + self->size_hint / 8 + plen + 64};
    o.bytes = PyBytes_FromStringAndSize(NULL, o.cap);
    if (o.bytes == NULL)
        return NULL;
    o.buf = PyBytes_AS_STRING(o.bytes);
    memcpy(o.buf, PyBytes_AS_STRING(args[1]), (size_t)plen);
    if (put_value(self, &self->nodes[self->top], args[0], &o) < 0) {
        Py_DECREF(o.bytes);
        return NULL;
    }
    self->size_hint = o.len - plen;
    if (o.len != o.cap && _PyBytes_Resize(&o.bytes, o.len) < 0)
        return NULL;
    return o.bytes;
}

static PyObject *
Program_decode(Program *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "decode(buf: bytes, pos: int)");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    In in = {.obj = args[0],
             .buf = (const unsigned char *)PyBytes_AS_STRING(args[0]),
             .len = PyBytes_GET_SIZE(args[0]),
             .pos = pos};
    if (pos < 0 || pos > in.len)
        return truncated();
    PyObject *value = get_value(self, &self->nodes[self->top], &in);
    return value == NULL ? NULL : Py_BuildValue("(Nn)", value, in.pos);
}

static PyMethodDef Program_methods[] = {
    {"encode", (PyCFunction)(void (*)(void))Program_encode, METH_FASTCALL,
     "encode(datum, prefix) -> prefix + the datum's Avro binary encoding"},
    {"decode", (PyCFunction)(void (*)(void))Program_decode, METH_FASTCALL,
     "decode(buf, pos) -> (datum, end)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ProgramType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pipeline.records._avro_native.Program",
    .tp_basicsize = sizeof(Program),
    .tp_dealloc = (destructor)Program_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Program(nodes, top): an Avro writer and reader of one schema",
    .tp_methods = Program_methods,
    .tp_new = Program_new,
};

static PyObject *
configure(PyObject *module, PyObject *error)
{
    if (!PyType_Check(error) || !PyType_IsSubtype((PyTypeObject *)error,
                                                  (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "configure(RecordDecodeError)");
        return NULL;
    }
    Py_XSETREF(DecodeError, Py_NewRef(error));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_O, "configure(error_type): the exception refusals raise"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pipeline.records._avro_native",
    .m_doc = "Avro binary encoding in C (pipeline.records.avro_binary is the reference)",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__avro_native(void)
{
    str_dtype = PyUnicode_InternFromString("dtype");
    if (str_dtype == NULL || PyType_Ready(&ProgramType) < 0)
        return NULL;
    DecodeError = Py_NewRef(PyExc_ValueError);
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "K_NULL", K_NULL) < 0
        || PyModule_AddIntConstant(m, "K_BOOLEAN", K_BOOLEAN) < 0
        || PyModule_AddIntConstant(m, "K_INT", K_INT) < 0
        || PyModule_AddIntConstant(m, "K_LONG", K_LONG) < 0
        || PyModule_AddIntConstant(m, "K_FLOAT", K_FLOAT) < 0
        || PyModule_AddIntConstant(m, "K_DOUBLE", K_DOUBLE) < 0
        || PyModule_AddIntConstant(m, "K_STRING", K_STRING) < 0
        || PyModule_AddIntConstant(m, "K_BYTES", K_BYTES) < 0
        || PyModule_AddIntConstant(m, "K_FIXED", K_FIXED) < 0
        || PyModule_AddIntConstant(m, "K_ENUM", K_ENUM) < 0
        || PyModule_AddIntConstant(m, "K_ARRAY", K_ARRAY) < 0
        || PyModule_AddIntConstant(m, "K_MAP", K_MAP) < 0
        || PyModule_AddIntConstant(m, "K_UNION", K_UNION) < 0
        || PyModule_AddIntConstant(m, "K_RECORD", K_RECORD) < 0
        || PyModule_AddObjectRef(m, "Program", (PyObject *)&ProgramType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
