/* The benchmark subscriber's per-frame loop (bench/pg_subscribers.py, RawSocket).
 *
 * On a 2-core machine the subscriber process shares the cores with the service
 * it measures: in Python its frame loop cost ~3 us a v6 frame, CPU taken from
 * the service. This is the same loop for the common frames only.
 *
 * scan_acks(buf, pos) -> (pos, acks, count, last_start, last_end, stuck)
 *
 * Walks the whole frames in buf from pos. For each final, unmasked text frame
 * whose payload opens with {"id":N, (what every server message is) it appends
 * the ack frame the Python client writes for it: a masked text frame with the
 * all-zero key and the payload {"ack":N}. It stops at the first frame it does
 * not take: an incomplete one (stuck = False: wait for more bytes) or a whole
 * one of another kind — a ping, a close, a fragment, an odd payload (stuck =
 * True: the Python scanner takes it from there). last_start:last_end is the
 * payload of the last frame taken. Returns pos after the frames taken.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_ID 20 /* digits: the ack payload stays below 126 bytes */

static PyObject *scan_acks(PyObject *self, PyObject *args) {
    const unsigned char *buf;
    Py_ssize_t size, pos;
    if (!PyArg_ParseTuple(args, "y#n", &buf, &size, &pos)) {
        return NULL;
    }
    if (pos < 0 || pos > size) {
        PyErr_SetString(PyExc_ValueError, "pos out of range");
        return NULL;
    }
    /* Each ack frame is at most 6 + 8 + MAX_ID bytes; frames are at least 8. */
    Py_ssize_t cap = 256, used = 0, count = 0, last_start = 0, last_end = 0;
    int stuck = 0;
    unsigned char *out = PyMem_Malloc(cap);
    if (out == NULL) {
        return PyErr_NoMemory();
    }
    while (size - pos >= 2) {
        unsigned char b0 = buf[pos], b1 = buf[pos + 1];
        Py_ssize_t length = b1 & 0x7F, head = 2;
        if (length == 126) {
            if (size - pos < 4) {
                break;
            }
            length = ((Py_ssize_t)buf[pos + 2] << 8) | buf[pos + 3];
            head = 4;
        } else if (length == 127) {
            if (size - pos < 10) {
                break;
            }
            unsigned long long n = 0;
            for (int i = 2; i < 10; i++) {
                n = (n << 8) | buf[pos + i];
            }
            if (n > (unsigned long long)PY_SSIZE_T_MAX) {
                stuck = 1;
                break;
            }
            length = (Py_ssize_t)n;
            head = 10;
        }
        if (length > size - pos - head) {
            break; /* incomplete */
        }
        Py_ssize_t start = pos + head, end = start + length;
        if (b0 != 0x81 || (b1 & 0x80) || length < 8 || memcmp(buf + start, "{\"id\":", 6) != 0) {
            stuck = 1;
            break;
        }
        Py_ssize_t digits = 0;
        while (start + 6 + digits < end && digits <= MAX_ID &&
               buf[start + 6 + digits] >= '0' && buf[start + 6 + digits] <= '9') {
            digits++;
        }
        if (digits == 0 || digits > MAX_ID || start + 6 + digits >= end ||
            buf[start + 6 + digits] != ',') {
            stuck = 1;
            break;
        }
        Py_ssize_t frame = 6 + 7 + digits + 1;
        if (used + frame > cap) {
            cap = cap * 2 + frame;
            unsigned char *grown = PyMem_Realloc(out, cap);
            if (grown == NULL) {
                PyMem_Free(out);
                return PyErr_NoMemory();
            }
            out = grown;
        }
        unsigned char *p = out + used;
        p[0] = 0x81;
        p[1] = (unsigned char)(0x80 | (7 + digits + 1));
        memset(p + 2, 0, 4);
        memcpy(p + 6, "{\"ack\":", 7);
        memcpy(p + 13, buf + start + 6, digits);
        p[13 + digits] = '}';
        used += frame;
        count++;
        last_start = start;
        last_end = end;
        pos = end;
    }
    PyObject *acks = PyBytes_FromStringAndSize((const char *)out, used);
    PyMem_Free(out);
    if (acks == NULL) {
        return NULL;
    }
    return Py_BuildValue("(nNnnnO)", pos, acks, count, last_start, last_end,
                         stuck ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"scan_acks", scan_acks, METH_VARARGS, "Acks for the whole text frames from pos."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rawscan", "The benchmark subscriber's frame loop.", -1, methods,
};

PyMODINIT_FUNC PyInit__rawscan(void) { return PyModule_Create(&module); }
