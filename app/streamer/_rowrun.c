/* encode_rows in C: app/streamer/rowrun.py documents it, and encode_rows_py there
 * is the same function in Python (the fallback, and the reference that
 * tests/streamer/test_rowrun.py compares this against).
 *
 * Per row change this is one attribute read for the tag and one for the body, the
 * canonical JSON (canonical_json.encode_fast, itself C), the message text, and
 * one append: the Python loop pays ~1-2 us of interpreter work on top.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Set once by rowrun.py. */
static PyObject *data_type = NULL;   /* app.protocol.messages.Data */
static PyObject *change_type = NULL; /* app.streamer.subscriber.Change (a tuple subclass) */
static PyObject *encode_fast = NULL; /* canonical_json.encode_fast: str or None */
static PyObject *str_tag = NULL;
static PyObject *str_body = NULL;
static PyObject *str_prefix = NULL; /* ["data", */
static PyObject *str_suffix = NULL; /* ] */

static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *data, *change, *encode;
    if (!PyArg_ParseTuple(args, "O!O!O:setup", &PyType_Type, &data, &PyType_Type, &change,
                          &encode)) {
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)change, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "setup: the change type must be a tuple subclass");
        return NULL;
    }
    if (!PyCallable_Check(encode)) {
        PyErr_SetString(PyExc_TypeError, "setup: encode_fast must be callable");
        return NULL;
    }
    if (str_tag == NULL) {
        str_tag = PyUnicode_InternFromString("tag");
        str_body = PyUnicode_InternFromString("body");
        str_prefix = PyUnicode_FromString("[\"data\",");
        str_suffix = PyUnicode_FromString("]");
        if (str_tag == NULL || str_body == NULL || str_prefix == NULL || str_suffix == NULL) {
            return NULL;
        }
    }
    Py_INCREF(data);
    Py_INCREF(change);
    Py_INCREF(encode);
    Py_XSETREF(data_type, data);
    Py_XSETREF(change_type, change);
    Py_XSETREF(encode_fast, encode);
    Py_RETURN_NONE;
}

/* '["data",' + change_json + ']' */
static PyObject *message_text(PyObject *change_json) {
    if (PyUnicode_IS_ASCII(change_json)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(change_json);
        PyObject *text = PyUnicode_New(n + 9, 127);
        if (text == NULL) {
            return NULL;
        }
        Py_UCS1 *out = PyUnicode_1BYTE_DATA(text);
        memcpy(out, "[\"data\",", 8);
        memcpy(out + 8, PyUnicode_1BYTE_DATA(change_json), n);
        out[n + 8] = ']';
        return text;
    }
    PyObject *head = PyUnicode_Concat(str_prefix, change_json);
    if (head == NULL) {
        return NULL;
    }
    PyObject *text = PyUnicode_Concat(head, str_suffix);
    Py_DECREF(head);
    return text;
}

/* Change(watermark, tag, text), built as tuple.__new__ builds a subclass instance. */
static PyObject *new_change(PyObject *watermark, PyObject *tag, PyObject *text) {
    PyTypeObject *type = (PyTypeObject *)change_type;
    PyObject *change = type->tp_alloc(type, 3);
    if (change == NULL) {
        return NULL;
    }
    Py_INCREF(watermark);
    Py_INCREF(tag);
    Py_INCREF(text);
    PyTuple_SET_ITEM(change, 0, watermark);
    PyTuple_SET_ITEM(change, 1, tag);
    PyTuple_SET_ITEM(change, 2, text);
    return change;
}

static PyObject *encode_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "encode_rows(messages, start, watermark, changes, budget)");
        return NULL;
    }
    if (data_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_rowrun.encode_rows called before _rowrun.setup");
        return NULL;
    }
    PyObject *messages = args[0], *watermark = args[2], *changes = args[3];
    if (!PyList_Check(messages) || !PyUnicode_Check(watermark) || !PyList_Check(changes)) {
        PyErr_SetString(PyExc_TypeError,
                        "encode_rows: messages and changes are lists, watermark a str");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    Py_ssize_t budget = PyLong_AsSsize_t(args[4]);
    if ((start == -1 || budget == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "encode_rows: start must not be negative");
        return NULL;
    }
    Py_ssize_t i = start;
    Py_ssize_t used = 0;
    /* The list may not change under us: nothing called here runs Python code that
       sees it (encode_fast only sees the change body). */
    while (i < PyList_GET_SIZE(messages)) {
        PyObject *message = PyList_GET_ITEM(messages, i);
        if ((PyObject *)Py_TYPE(message) != data_type) {
            break;
        }
        PyObject *tag = PyObject_GetAttr(message, str_tag);
        if (tag == NULL) {
            return NULL;
        }
        PyObject *body = PyObject_GetAttr(message, str_body);
        if (body == NULL) {
            Py_DECREF(tag);
            return NULL;
        }
        PyObject *change_json = PyObject_CallOneArg(encode_fast, body);
        Py_DECREF(body);
        if (change_json == NULL) {
            Py_DECREF(tag);
            return NULL;
        }
        if (change_json == Py_None) {
            Py_DECREF(change_json);
            Py_DECREF(tag);
            break;
        }
        if (!PyUnicode_Check(change_json)) {
            Py_DECREF(change_json);
            Py_DECREF(tag);
            PyErr_SetString(PyExc_TypeError, "encode_rows: encode_fast returned a non-str");
            return NULL;
        }
        PyObject *text = message_text(change_json);
        Py_DECREF(change_json);
        PyObject *change = text == NULL ? NULL : new_change(watermark, tag, text);
        Py_DECREF(tag);
        if (change == NULL) {
            Py_XDECREF(text);
            return NULL;
        }
        used += PyUnicode_GET_LENGTH(text);
        Py_DECREF(text);
        int failed = PyList_Append(changes, change) < 0;
        Py_DECREF(change);
        if (failed) {
            return NULL;
        }
        i++;
        if (used >= budget) {
            break;
        }
    }
    return Py_BuildValue("(nn)", i, used);
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(Data, Change, encode_fast): the types and helpers encode_rows uses."},
    {"encode_rows", (PyCFunction)(void (*)(void))encode_rows, METH_FASTCALL,
     "encode_rows(messages, start, watermark, changes, budget) -> (end, used)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowrun", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowrun(void) { return PyModule_Create(&module); }
