/* The per-change, per-subscriber loops of live fan-out, in C.
 *
 * Subscriber._emit picks the changes a subscriber takes from a batch (select_live:
 * live, caught up or drained from its backlog) and Downstream.push records the
 * running byte totals of what
 * it queued (running_totals). Both run once per change *per subscriber*: at 16
 * subscribers they were ~14 us of the main loop's ~60 us per change. The Python
 * twins (_select_live_py in subscriber.py, _running_totals_py in downstream.py)
 * are the fallback and the reference that tests/streamer/test_fanout_c.py compares
 * these against.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *str_append = NULL;

/* select_live(changes, watermark, unsupported, pushed, texts, commits) -> watermark */
static PyObject *select_live(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "select_live(changes, watermark, unsupported, pushed, texts, commits)");
        return NULL;
    }
    PyObject *changes = args[0], *watermark = args[1], *unsupported = args[2];
    PyObject *texts = args[4], *commits = args[5];
    if (!PyList_Check(changes) || !PyUnicode_Check(watermark) ||
        !PyAnySet_Check(unsupported) || !PyList_Check(texts)) {
        PyErr_SetString(PyExc_TypeError,
                        "select_live: changes and texts are lists, watermark a str, "
                        "unsupported a set");
        return NULL;
    }
    Py_ssize_t pushed = PyLong_AsSsize_t(args[3]);
    if (pushed == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int filter_tags = PySet_GET_SIZE(unsupported) > 0;
    Py_INCREF(watermark);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(changes); i++) {
        PyObject *change = PyList_GET_ITEM(changes, i);
        if (!PyTuple_Check(change) || PyTuple_GET_SIZE(change) != 3) {
            Py_DECREF(watermark);
            PyErr_SetString(PyExc_TypeError, "select_live: a change is a 3-tuple");
            return NULL;
        }
        PyObject *w = PyTuple_GET_ITEM(change, 0);
        PyObject *tag = PyTuple_GET_ITEM(change, 1);
        int old = PyObject_RichCompareBool(w, watermark, Py_LE);
        if (old < 0) {
            Py_DECREF(watermark);
            return NULL;
        }
        if (old) {
            continue;
        }
        if (filter_tags) {
            int skip = PySet_Contains(unsupported, tag);
            if (skip < 0) {
                Py_DECREF(watermark);
                return NULL;
            }
            if (skip) {
                continue;
            }
        }
        if (PyList_Append(texts, PyTuple_GET_ITEM(change, 2)) < 0) {
            Py_DECREF(watermark);
            return NULL;
        }
        if (PyUnicode_Check(tag) && PyUnicode_CompareWithASCIIString(tag, "commit") == 0) {
            Py_INCREF(w);
            Py_SETREF(watermark, w);
            PyObject *entry = Py_BuildValue("(nO)", pushed + PyList_GET_SIZE(texts), w);
            if (entry == NULL) {
                Py_DECREF(watermark);
                return NULL;
            }
            PyObject *done = PyObject_CallMethodOneArg(commits, str_append, entry);
            Py_DECREF(entry);
            if (done == NULL) {
                Py_DECREF(watermark);
                return NULL;
            }
            Py_DECREF(done);
        }
    }
    return watermark;
}

/* running_totals(ends, messages, total) -> total: appends total += len(m) per message */
static PyObject *running_totals(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "running_totals(ends: list, messages: list, total)");
        return NULL;
    }
    PyObject *ends = args[0], *messages = args[1];
    Py_ssize_t total = PyLong_AsSsize_t(args[2]);
    if (total == -1 && PyErr_Occurred()) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(messages); i++) {
        PyObject *message = PyList_GET_ITEM(messages, i);
        Py_ssize_t n = PyObject_Length(message);
        if (n < 0) {
            return NULL;
        }
        total += n;
        PyObject *value = PyLong_FromSsize_t(total);
        if (value == NULL) {
            return NULL;
        }
        int failed = PyList_Append(ends, value) < 0;
        Py_DECREF(value);
        if (failed) {
            return NULL;
        }
    }
    return PyLong_FromSsize_t(total);
}

static PyMethodDef methods[] = {
    {"select_live", (PyCFunction)(void (*)(void))select_live, METH_FASTCALL,
     "select_live(changes, watermark, unsupported, pushed, texts, commits) -> watermark"},
    {"running_totals", (PyCFunction)(void (*)(void))running_totals, METH_FASTCALL,
     "running_totals(ends, messages, total) -> total"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fanout", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fanout(void) {
    str_append = PyUnicode_InternFromString("append");
    if (str_append == NULL) {
        return NULL;
    }
    return PyModule_Create(&module);
}
