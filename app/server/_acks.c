/* The ack frames of one socket read, parsed in one call (app/server/ws_protocol.py).
 *
 * Every v6 subscriber answers every message with a masked {"ack":N} text frame,
 * so the server reads about as many ack frames as it sends messages. In Python
 * the per-frame work (header checks, unmasking, digit checks, int) cost ~1.5 us a
 * frame, ~13 % of the event loop at one subscriber. ack_ids keeps the Python
 * version's exact contract (ws_protocol._ack_ids_py, which the tests compare it
 * against): the ids if `data` is only whole, masked, final text frames of
 * canonical {"ack":N} (digits, no leading zero), else None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FIN_TEXT 0x81
#define MASKED 0x80
#define MIN_ACK 9  /* {"ack":N} with one digit */
#define MAX_ACK 24 /* 16 digits: far beyond any frame id, within a long long */

static const unsigned char PREFIX[7] = {'{', '"', 'a', 'c', 'k', '"', ':'};

static PyObject *ack_ids(PyObject *self, PyObject *arg) {
    char *buf;
    Py_ssize_t end;
    if (PyBytes_AsStringAndSize(arg, &buf, &end) < 0) {
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)buf;
    PyObject *ids = PyList_New(0);
    if (ids == NULL) {
        return NULL;
    }
    Py_ssize_t pos = 0;
    while (pos < end) {
        if (end - pos < 2 || data[pos] != FIN_TEXT) {
            goto not_acks;
        }
        Py_ssize_t length = data[pos + 1] ^ MASKED; /* also rejects an unmasked frame */
        if (length < MIN_ACK || length > MAX_ACK) {
            goto not_acks;
        }
        Py_ssize_t start = pos + 6;
        pos = start + length;
        if (pos > end) {
            goto not_acks;
        }
        const unsigned char *key = data + start - 4;
        unsigned char payload[MAX_ACK];
        for (Py_ssize_t i = 0; i < length; i++) {
            payload[i] = data[start + i] ^ key[i & 3];
        }
        if (memcmp(payload, PREFIX, sizeof PREFIX) != 0 || payload[length - 1] != '}') {
            goto not_acks;
        }
        Py_ssize_t first = sizeof PREFIX, digits = length - 1 - first;
        if (payload[first] == '0' && digits > 1) {
            goto not_acks; /* a leading zero is not canonical */
        }
        long long id = 0;
        for (Py_ssize_t i = first; i < first + digits; i++) {
            if (payload[i] < '0' || payload[i] > '9') {
                goto not_acks;
            }
            id = id * 10 + (payload[i] - '0');
        }
        PyObject *value = PyLong_FromLongLong(id);
        if (value == NULL || PyList_Append(ids, value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(ids);
            return NULL;
        }
        Py_DECREF(value);
    }
    return ids;
not_acks:
    Py_DECREF(ids);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"ack_ids", ack_ids, METH_O,
     "ack_ids(data: bytes) -> list[int] | None: the ids of whole masked {\"ack\":N} frames."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_acks", NULL, -1, methods};

PyMODINIT_FUNC PyInit__acks(void) { return PyModule_Create(&module); }
