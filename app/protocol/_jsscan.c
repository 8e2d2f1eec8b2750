/* The fast path of canonical_json.dumps in one C call, and the scan it relies on.
 *
 * app/protocol/canonical_json.py needs to know whether orjson's text of a value holds
 *   1  an integral float as orjson writes it:  ".0" then , ] or }
 *   2  an exponent float:                      "e", a sign, digits, then , ] or }
 *   4  a null (orjson also writes NaN and Infinity as null).
 * scan() answers the three questions in one memchr-driven pass (the Python regex
 * scans cost ~1.2 us for a ~220-byte change, more than orjson itself).
 *
 * encode() is the whole common case: orjson.dumps, the scan, and the decode to str,
 * without a Python frame in between (~0.7 us of a ~1.7 us dumps). It returns None
 * whenever canonical_json.py must decide (an orjson error, a float orjson writes
 * differently from JS, a null that may hide a NaN): the Python code then runs its
 * full path. The pure-Python twins (scan_py, _encode_fast_py) stay in
 * canonical_json.py as the fallback and as the reference the tests compare against
 * (tests/protocol/test_jsscan.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static int closes_token(unsigned char c) { return c == ',' || c == ']' || c == '}'; }
static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

static long scan_buffer(const unsigned char *p, Py_ssize_t n) {
    long flags = 0;
    const unsigned char *end = p + n;
    const unsigned char *q;
    /* ".0" then , ] or } */
    for (q = p; (q = memchr(q, '.', end - q)) != NULL; q++) {
        if (end - q > 2 && q[1] == '0' && closes_token(q[2])) {
            flags |= 1;
            break;
        }
    }
    /* "e", a sign, digits, then , ] or } */
    for (q = p; (q = memchr(q, 'e', end - q)) != NULL; q++) {
        if (end - q > 2 && (q[1] == '+' || q[1] == '-') && is_digit(q[2])) {
            const unsigned char *d = q + 3;
            while (d < end && is_digit(*d)) {
                d++;
            }
            if (d < end && closes_token(*d)) {
                flags |= 2;
                break;
            }
        }
    }
    /* null */
    for (q = p; (q = memchr(q, 'n', end - q)) != NULL; q++) {
        if (end - q > 3 && q[1] == 'u' && q[2] == 'l' && q[3] == 'l') {
            flags |= 4;
            break;
        }
    }
    return flags;
}

static PyObject *scan(PyObject *self, PyObject *arg) {
    char *buf;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(arg, &buf, &n) < 0) {
        return NULL;
    }
    return PyLong_FromLong(scan_buffer((const unsigned char *)buf, n));
}

/* Set once by canonical_json.py: orjson.dumps, its option, the non-finite pre-check. */
static PyObject *orjson_dumps = NULL;
static PyObject *option_args = NULL;   /* (option,) */
static PyObject *option_names = NULL;  /* ("option",) */
static PyObject *may_hold_non_finite = NULL;

static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *dumps, *option, *check;
    if (!PyArg_ParseTuple(args, "OOO:setup", &dumps, &option, &check)) {
        return NULL;
    }
    if (!PyCallable_Check(dumps) || !PyCallable_Check(check)) {
        PyErr_SetString(PyExc_TypeError, "setup(dumps, option, may_hold_non_finite): not callable");
        return NULL;
    }
    /* Interned: orjson matches keyword names by identity with its own "option". */
    PyObject *name = PyUnicode_InternFromString("option");
    PyObject *names = name == NULL ? NULL : PyTuple_Pack(1, name);
    Py_XDECREF(name);
    PyObject *values = PyTuple_Pack(1, option);
    if (names == NULL || values == NULL) {
        Py_XDECREF(names);
        Py_XDECREF(values);
        return NULL;
    }
    Py_INCREF(dumps);
    Py_INCREF(check);
    Py_XSETREF(orjson_dumps, dumps);
    Py_XSETREF(may_hold_non_finite, check);
    Py_XSETREF(option_names, names);
    Py_XSETREF(option_args, values);
    Py_RETURN_NONE;
}

static PyObject *encode(PyObject *self, PyObject *value) {
    if (orjson_dumps == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_jsscan.encode called before _jsscan.setup");
        return NULL;
    }
    PyTypeObject *t = Py_TYPE(value);
    if (t != &PyDict_Type && t != &PyList_Type && t != &PyTuple_Type) {
        Py_RETURN_NONE;
    }
    PyObject *argv[2] = {value, PyTuple_GET_ITEM(option_args, 0)};
    PyObject *out = PyObject_Vectorcall(orjson_dumps, argv, 1, option_names);
    if (out == NULL) {
        /* Big ints, lone surrogates, deep nesting, non-JSON types: the Python path
           handles or reports each (it calls orjson again to get the same error). */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (!PyBytes_Check(out)) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_TypeError, "orjson.dumps did not return bytes");
        return NULL;
    }
    const char *buf = PyBytes_AS_STRING(out);
    Py_ssize_t n = PyBytes_GET_SIZE(out);
    long flags = scan_buffer((const unsigned char *)buf, n);
    if (flags & 3) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    if (flags & 4) {
        PyObject *maybe = PyObject_CallOneArg(may_hold_non_finite, value);
        if (maybe == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        int truth = PyObject_IsTrue(maybe);
        Py_DECREF(maybe);
        if (truth != 0) {
            Py_DECREF(out);
            if (truth < 0) {
                return NULL;
            }
            Py_RETURN_NONE;
        }
    }
    PyObject *text = PyUnicode_DecodeUTF8(buf, n, "strict");
    Py_DECREF(out);
    return text;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O,
     "scan(data: bytes) -> int: 1 integral float, 2 exponent float, 4 null (or-ed)."},
    {"setup", setup, METH_VARARGS,
     "setup(dumps, option, may_hold_non_finite): what encode() calls."},
    {"encode", encode, METH_O,
     "encode(value) -> str | None: orjson's text if it is already canonical, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jsscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jsscan(void) { return PyModule_Create(&module); }
