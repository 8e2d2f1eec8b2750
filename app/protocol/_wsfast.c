/* The per-frame byte work of the websocket fast path (app/protocol/wsframes.py).
 *
 * msg_frames: a run of v6 frames {"id":N,"msg":<message>} with their headers, as
 * one bytes object to write. Built in Python it was ~1 us a frame (an id, four
 * concatenations, an encode, a header), paid once per message per subscriber.
 *
 * ack_ids: the ack frames of one socket read, parsed in one call. Every v6 subscriber answers every message with a masked {"ack":N} text frame,
 * so the server reads about as many ack frames as it sends messages. In Python
 * the per-frame work (header checks, unmasking, digit checks, int) cost ~1.5 us a
 * frame, ~13 % of the event loop at one subscriber. ack_ids keeps the Python
 * version's exact contract (wsframes.ack_ids_py, which the tests compare it
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

static Py_ssize_t count_digits(unsigned long long v) {
    Py_ssize_t n = 1;
    while (v >= 10) {
        v /= 10;
        n++;
    }
    return n;
}

static char *put(char *out, const char *s, Py_ssize_t n) {
    memcpy(out, s, (size_t)n);
    return out + n;
}

static const char ID_OPEN[] = "{\"id\":";   /* {"id": */
static const char MSG_OPEN[] = ",\"msg\":"; /* ,"msg": */
#define ID_OPEN_LEN 6
#define MSG_OPEN_LEN 7

static Py_ssize_t frame_header_len(Py_ssize_t payload) {
    return payload < 126 ? 2 : payload < 65536 ? 4 : 10;
}

static PyObject *msg_frames(PyObject *self, PyObject *args) {
    unsigned long long first_id;
    PyObject *messages;
    if (!PyArg_ParseTuple(args, "KO!:msg_frames", &first_id, &PyList_Type, &messages)) {
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(messages);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(messages, i);
        if (!PyUnicode_Check(item)) {
            PyErr_Format(PyExc_TypeError, "messages must be str, not %.100s", Py_TYPE(item)->tp_name);
            return NULL;
        }
        Py_ssize_t len;
        if (PyUnicode_AsUTF8AndSize(item, &len) == NULL) {
            return NULL; /* e.g. a lone surrogate: not encodable */
        }
        Py_ssize_t payload = ID_OPEN_LEN + count_digits(first_id + (unsigned long long)i) +
                             MSG_OPEN_LEN + len + 1;
        total += frame_header_len(payload) + payload;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL) {
        return NULL;
    }
    char *out = PyBytes_AS_STRING(result);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t len;
        const char *utf8 = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(messages, i), &len);
        unsigned long long id = first_id + (unsigned long long)i;
        Py_ssize_t digits = count_digits(id);
        Py_ssize_t payload = ID_OPEN_LEN + digits + MSG_OPEN_LEN + len + 1;
        *out++ = (char)0x81; /* FIN, text */
        if (payload < 126) {
            *out++ = (char)payload;
        } else if (payload < 65536) {
            *out++ = 126;
            *out++ = (char)(payload >> 8);
            *out++ = (char)payload;
        } else {
            *out++ = 127;
            for (int shift = 56; shift >= 0; shift -= 8) {
                *out++ = (char)((unsigned long long)payload >> shift);
            }
        }
        out = put(out, ID_OPEN, ID_OPEN_LEN);
        for (Py_ssize_t d = digits - 1; d >= 0; d--) {
            out[d] = (char)('0' + id % 10);
            id /= 10;
        }
        out += digits;
        out = put(out, MSG_OPEN, MSG_OPEN_LEN);
        out = put(out, utf8, len);
        *out++ = '}';
    }
    return result;
}

static PyMethodDef methods[] = {
    {"ack_ids", ack_ids, METH_O,
     "ack_ids(data: bytes) -> list[int] | None: the ids of whole masked {\"ack\":N} frames."},
    {"msg_frames", msg_frames, METH_VARARGS,
     "msg_frames(first_id: int, messages: list[str]) -> bytes: v6 frames, headers included."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wsfast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wsfast(void) { return PyModule_Create(&module); }
