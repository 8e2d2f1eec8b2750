/* The common pgoutput messages straight to their change-source messages: a row
 * change (Insert, Update, Delete) to its Data, a Begin to its Begin and a Commit to
 * its Commit.
 *
 * app/sources/postgres/mapper.py documents the contract (ChangeMapper.map_common).
 * The reference is the pure-Python path, decode_message() then ChangeMapper.map():
 * this kernel gives the same Data or, for anything it does not handle exactly as
 * that path does, None, and the caller takes that path (which raises the precise
 * error where there is one).  It returns None for: a message that is not I/U/D/B/C, a
 * truncated or over-long message, an unknown tuple marker or column kind, a binary
 * column value, and a value parser that raised.  tests/sources/postgres/
 * test_pgrows.py compares the two on generated messages, valid and broken.
 *
 * Per row this replaces two frozen dataclasses, a Python loop per tuple and one per
 * row dict (~12 us per 4-column row on the bench machine) with one pass over the
 * bytes; values whose parser is `str` (text, varchar, uuid, json sent as text...),
 * an integer or a bool are converted here, other types call their Python parser.
 *
 * A one-row transaction is three messages, so Begin and Commit are here too: in
 * Python each was a frozen dataclass from the decoder, its body built in Python and
 * two LSNs formatted (a third of the source's time per 1-row transaction).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Column kinds, as values.parser_kind() numbers them. */
enum { KIND_CALL = 0, KIND_TEXT = 1, KIND_INT = 2, KIND_BOOL = 3 };

/* Set once by mapper.py. */
static PyObject *data_type = NULL;      /* app.protocol.messages.Data */
static PyObject *unchanged_toast = NULL; /* pgoutput.UNCHANGED_TOAST */
static PyObject *begin_type = NULL;     /* app.protocol.messages.Begin */
static PyObject *commit_type = NULL;    /* app.protocol.messages.Commit */
static PyObject *s_tag, *s_body, *s_relation, *s_new, *s_old, *s_key, *s_insert, *s_update, *s_delete;
static PyObject *s_begin, *s_commit, *s_commit_lsn, *s_commit_time, *s_xid, *s_json, *s_stringified,
    *s_flags, *s_commit_end_lsn, *s_commit_time_ms, *s_commit_watermark, *s_skip_ack, *s_watermark;

/* Postgres timestamps count from 2000-01-01; the output's from 1970 (pgoutput.py). */
#define PG_EPOCH_OFFSET_US INT64_C(946684800000000)

static int intern_all(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_tag, "tag"},
        {&s_body, "body"},
        {&s_relation, "relation"},
        {&s_new, "new"},
        {&s_old, "old"},
        {&s_key, "key"},
        {&s_insert, "insert"},
        {&s_update, "update"},
        {&s_delete, "delete"},
        {&s_begin, "begin"},
        {&s_commit, "commit"},
        {&s_commit_lsn, "commitLsn"},
        {&s_commit_time, "commitTime"},
        {&s_xid, "xid"},
        {&s_json, "json"},
        {&s_stringified, "s"},
        {&s_flags, "flags"},
        {&s_commit_end_lsn, "commitEndLsn"},
        {&s_commit_time_ms, "commitTimeMs"},
        {&s_commit_watermark, "commit_watermark"},
        {&s_skip_ack, "skip_ack"},
        {&s_watermark, "watermark"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) {
            return -1;
        }
    }
    return 0;
}

static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *data, *toast, *begin, *commit;
    if (!PyArg_ParseTuple(args, "O!OO!O!:setup", &PyType_Type, &data, &toast, &PyType_Type, &begin,
                          &PyType_Type, &commit)) {
        return NULL;
    }
    if (intern_all() < 0) {
        return NULL;
    }
    Py_INCREF(data);
    Py_INCREF(toast);
    Py_INCREF(begin);
    Py_INCREF(commit);
    Py_XSETREF(data_type, data);
    Py_XSETREF(unchanged_toast, toast);
    Py_XSETREF(begin_type, begin);
    Py_XSETREF(commit_type, commit);
    Py_RETURN_NONE;
}


/* Result of a step: OK, FALLBACK (no Python error set: take the Python path), or
 * ERROR (a Python error is set and must propagate, e.g. MemoryError). */
typedef enum { OK = 0, FALLBACK = 1, ERROR = 2 } step;

/* A raised exception: an ordinary one means "take the Python path" (it raises the
 * same thing with its context); anything else (MemoryError, KeyboardInterrupt)
 * propagates. */
static step on_raised(void) {
    if (PyErr_ExceptionMatches(PyExc_MemoryError) || !PyErr_ExceptionMatches(PyExc_Exception)) {
        return ERROR;
    }
    PyErr_Clear();
    return FALLBACK;
}

typedef struct {
    PyObject *json;  /* the relation object, shared by every row */
    PyObject *names; /* tuple[str, ...] */
    PyObject *parsers;
    const char *kinds; /* one byte per column */
    Py_ssize_t ncols;
    PyObject *key_indexes; /* tuple[int, ...] */
} relation;

static int read_be32(const unsigned char *p) {
    return (int)(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3]);
}

/* Decodes TupleData at *pos into a new tuple of str / None / UNCHANGED_TOAST. */
static step read_tuple(const unsigned char *buf, Py_ssize_t size, Py_ssize_t *pos,
                       PyObject **out) {
    Py_ssize_t p = *pos;
    if (p + 2 > size) {
        return FALLBACK;
    }
    Py_ssize_t n = (int16_t)(((uint16_t)buf[p] << 8) | buf[p + 1]);
    p += 2;
    if (n < 0) {
        return FALLBACK;
    }
    PyObject *values = PyTuple_New(n);
    if (values == NULL) {
        return ERROR;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p >= size) {
            Py_DECREF(values);
            return FALLBACK;
        }
        unsigned char kind = buf[p];
        PyObject *v;
        if (kind == 't') {
            if (p + 5 > size) {
                Py_DECREF(values);
                return FALLBACK;
            }
            int len = read_be32(buf + p + 1);
            p += 5;
            if (len < 0 || len > size - p) {
                Py_DECREF(values);
                return FALLBACK;
            }
            /* Replacement of invalid UTF-8, as the Python decoder does. */
            v = PyUnicode_DecodeUTF8((const char *)buf + p, len, "replace");
            if (v == NULL) {
                Py_DECREF(values);
                return ERROR;
            }
            p += len;
        } else if (kind == 'n') {
            v = Py_NewRef(Py_None);
            p += 1;
        } else if (kind == 'u') {
            v = Py_NewRef(unchanged_toast);
            p += 1;
        } else {
            /* 'b' (binary: the mapper rejects it with its message) or unknown. */
            Py_DECREF(values);
            return FALLBACK;
        }
        PyTuple_SET_ITEM(values, i, v);
    }
    *pos = p;
    *out = values;
    return OK;
}

/* An integer of at most 18 digits (int() of it is the same number). */
static PyObject *small_int(PyObject *text) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    if (s == NULL) {
        return NULL;
    }
    Py_ssize_t i = (n > 0 && s[0] == '-') ? 1 : 0;
    if (n - i < 1 || n - i > 18) {
        return Py_NewRef(Py_None); /* not handled here */
    }
    long long value = 0;
    for (Py_ssize_t j = i; j < n; j++) {
        if (s[j] < '0' || s[j] > '9') {
            return Py_NewRef(Py_None);
        }
        value = value * 10 + (s[j] - '0');
    }
    return PyLong_FromLongLong(i ? -value : value);
}

/* The column value of `text` as the column's parser gives it. */
static step convert(const relation *rel, Py_ssize_t col, PyObject *text, PyObject **out) {
    char kind = rel->kinds[col];
    if (kind == KIND_TEXT) {
        *out = Py_NewRef(text);
        return OK;
    }
    if (kind == KIND_BOOL && PyUnicode_GET_LENGTH(text) == 1) {
        Py_UCS4 c = PyUnicode_READ_CHAR(text, 0);
        if (c == 't' || c == 'f') {
            *out = Py_NewRef(c == 't' ? Py_True : Py_False);
            return OK;
        }
    }
    if (kind == KIND_INT) {
        PyObject *v = small_int(text);
        if (v == NULL) {
            return on_raised();
        }
        if (v != Py_None) {
            *out = v;
            return OK;
        }
        Py_DECREF(v);
    }
    PyObject *v = PyObject_CallOneArg(PyTuple_GET_ITEM(rel->parsers, col), text);
    if (v == NULL) {
        return on_raised();
    }
    *out = v;
    return OK;
}

/* The mapper's _row(): names to converted values; an unchanged TOAST value comes
 * from `fallback` (the old row) when it has the column, else is left out. */
static step make_row(const relation *rel, PyObject *values, PyObject *fallback, PyObject **out) {
    Py_ssize_t n = PyTuple_GET_SIZE(values);
    if (n > rel->ncols) {
        n = rel->ncols;
    }
    PyObject *row = _PyDict_NewPresized(n);
    if (row == NULL) {
        return ERROR;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(rel->names, i);
        PyObject *v = PyTuple_GET_ITEM(values, i);
        PyObject *value;
        if (v == Py_None) {
            value = Py_NewRef(Py_None);
        } else if (v == unchanged_toast) {
            if (fallback == NULL) {
                continue;
            }
            value = PyDict_GetItemWithError(fallback, name);
            if (value == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(row);
                    return ERROR;
                }
                continue;
            }
            Py_INCREF(value);
        } else {
            step s = convert(rel, i, v, &value);
            if (s != OK) {
                Py_DECREF(row);
                return s;
            }
        }
        int failed = PyDict_SetItem(row, name, value) < 0;
        Py_DECREF(value);
        if (failed) {
            Py_DECREF(row);
            return ERROR;
        }
    }
    *out = row;
    return OK;
}

/* The mapper's _key(): the key columns present (as text) in a 'K' tuple. */
static step make_key(const relation *rel, PyObject *values, PyObject **out) {
    PyObject *key = PyDict_New();
    if (key == NULL) {
        return ERROR;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(values);
    Py_ssize_t nkeys = PyTuple_GET_SIZE(rel->key_indexes);
    for (Py_ssize_t k = 0; k < nkeys; k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(rel->key_indexes, k));
        if (i < 0 || i >= rel->ncols) {
            Py_DECREF(key);
            return PyErr_Occurred() ? on_raised() : FALLBACK;
        }
        if (i >= n) {
            continue;
        }
        PyObject *v = PyTuple_GET_ITEM(values, i);
        if (!PyUnicode_CheckExact(v)) {
            continue; /* NULL marks a non-key column */
        }
        PyObject *value;
        step s = convert(rel, i, v, &value);
        if (s != OK) {
            Py_DECREF(key);
            return s;
        }
        int failed = PyDict_SetItem(key, PyTuple_GET_ITEM(rel->names, i), value) < 0;
        Py_DECREF(value);
        if (failed) {
            Py_DECREF(key);
            return ERROR;
        }
    }
    *out = key;
    return OK;
}

/* {"tag": tag, "relation": json, k1: v1, ...} with the values' references stolen. */
static PyObject *body(PyObject *tag, PyObject *json, int n, PyObject **keys, PyObject **values) {
    PyObject *d = _PyDict_NewPresized(2 + n);
    int failed = d == NULL || PyDict_SetItem(d, s_tag, tag) < 0 ||
                 PyDict_SetItem(d, s_relation, json) < 0;
    for (int i = 0; i < n; i++) {
        failed = failed || PyDict_SetItem(d, keys[i], values[i]) < 0;
    }
    for (int i = 0; i < n; i++) {
        Py_DECREF(values[i]);
    }
    if (failed) {
        Py_XDECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *new_data(PyObject *b, PyObject *tag);

static PyObject *result(step s, PyObject *tag, PyObject *b) {
    if (s == ERROR) {
        return NULL;
    }
    if (s == FALLBACK) {
        Py_RETURN_NONE;
    }
    if (b == NULL) {
        return NULL;
    }
    PyObject *data = new_data(b, tag);
    Py_DECREF(b);
    return data;
}

/* A new instance of ``type``, its slots set directly: the messages are frozen slots
 * dataclasses, whose generated __init__ (a Python frame and an object.__setattr__
 * call per field) would cost half as much again as decoding a row. */
static PyObject *new_message(PyObject *type_object, int n, PyObject **names, PyObject **values) {
    PyTypeObject *type = (PyTypeObject *)type_object;
    PyObject *m = type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (PyObject_GenericSetAttr(m, names[i], values[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}

static PyObject *new_data(PyObject *b, PyObject *tag) {
    PyObject *names[2] = {s_body, s_tag}, *values[2] = {b, tag};
    return new_message(data_type, 2, names, values);
}

static uint64_t read_be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* format_lsn(): upper-case hex, 8 digits each side. */
static PyObject *lsn_text(uint64_t lsn) {
    char text[18];
    snprintf(text, sizeof text, "%08X/%08X", (unsigned)(lsn >> 32), (unsigned)(lsn & 0xFFFFFFFFu));
    return PyUnicode_FromStringAndSize(text, 17);
}

/* to_lexi(): base-36 digits, after one digit that says how many follow (minus one). */
static PyObject *lexi_text(uint64_t n) {
    static const char digits[] = "0123456789abcdefghijklmnopqrstuvwxyz";
    char text[16], reversed[14]; /* 2**64 has 13 base-36 digits */
    int len = 0;
    if (n < 36) {
        text[0] = '0';
        text[1] = digits[n];
        return PyUnicode_FromStringAndSize(text, 2);
    }
    while (n) {
        reversed[len++] = digits[n % 36];
        n /= 36;
    }
    text[0] = digits[len - 1];
    for (int i = 0; i < len; i++) {
        text[1 + i] = reversed[len - 1 - i];
    }
    return PyUnicode_FromStringAndSize(text, len + 1);
}

/* A commit time in Unix microseconds, or FALLBACK when it does not fit an int64
 * (the Python path's integers do not overflow). */
static step unix_us(const unsigned char *p, int64_t *out) {
    int64_t pg = (int64_t)read_be64(p);
    if (pg > INT64_MAX - PG_EPOCH_OFFSET_US) {
        return FALLBACK;
    }
    *out = pg + PG_EPOCH_OFFSET_US;
    return OK;
}

/* A dict of n keys from new references (stolen, also on failure). */
static PyObject *dict_of(int n, PyObject **keys, PyObject **values) {
    int failed = 0;
    for (int i = 0; i < n; i++) {
        failed = failed || values[i] == NULL;
    }
    PyObject *d = failed ? NULL : _PyDict_NewPresized(n);
    for (int i = 0; d != NULL && i < n; i++) {
        if (PyDict_SetItem(d, keys[i], values[i]) < 0) {
            Py_CLEAR(d);
        }
    }
    for (int i = 0; i < n; i++) {
        Py_XDECREF(values[i]);
    }
    return d;
}

/* Begin: final LSN, commit time, xid (21 bytes with the kind). */
static PyObject *begin_message(const unsigned char *buf, Py_ssize_t size) {
    int64_t time;
    if (size != 21 || unix_us(buf + 9, &time) != OK) {
        Py_RETURN_NONE;
    }
    uint64_t lsn = read_be64(buf + 1);
    PyObject *keys[5] = {s_tag, s_commit_lsn, s_commit_time, s_xid, s_json};
    PyObject *values[5] = {Py_NewRef(s_begin), lsn_text(lsn), PyLong_FromLongLong(time),
                           PyLong_FromLong((int32_t)read_be32(buf + 17)), Py_NewRef(s_stringified)};
    PyObject *b = dict_of(5, keys, values);
    PyObject *watermark = b == NULL ? NULL : lexi_text(lsn);
    if (watermark == NULL) {
        Py_XDECREF(b);
        return NULL;
    }
    PyObject *names[3] = {s_body, s_commit_watermark, s_skip_ack};
    PyObject *fields[3] = {b, watermark, Py_False};
    PyObject *m = new_message(begin_type, 3, names, fields);
    Py_DECREF(b);
    Py_DECREF(watermark);
    return m;
}

/* Commit: flags, commit LSN, end LSN, commit time (26 bytes with the kind). */
static PyObject *commit_message(const unsigned char *buf, Py_ssize_t size) {
    int64_t time;
    if (size != 26 || unix_us(buf + 18, &time) != OK) {
        Py_RETURN_NONE;
    }
    uint64_t lsn = read_be64(buf + 2);
    PyObject *keys[6] = {s_tag, s_flags, s_commit_lsn, s_commit_end_lsn, s_commit_time, s_commit_time_ms};
    /* C division truncates toward zero, as the reference's BigInt division does. */
    PyObject *values[6] = {Py_NewRef(s_commit),     PyLong_FromLong(buf[1]),
                           lsn_text(lsn),           lsn_text(read_be64(buf + 10)),
                           PyLong_FromLongLong(time), PyLong_FromLongLong(time / 1000)};
    PyObject *b = dict_of(6, keys, values);
    PyObject *watermark = b == NULL ? NULL : lexi_text(lsn);
    if (watermark == NULL) {
        Py_XDECREF(b);
        return NULL;
    }
    PyObject *names[2] = {s_body, s_watermark};
    PyObject *fields[2] = {b, watermark};
    PyObject *m = new_message(commit_type, 2, names, fields);
    Py_DECREF(b);
    Py_DECREF(watermark);
    return m;
}

static PyObject *decode_at(const unsigned char *buf, Py_ssize_t size, PyObject *specs);

/* decode(buffer, offset, specs) -> Data | Begin | Commit | None: the pgoutput message at
 * buffer[offset:] (bytes, or any contiguous buffer: psycopg's memoryview of libpq's
 * copy, read in place); specs maps relation OIDs to (json, names, parsers, kinds,
 * key_indexes). */
static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyObject_CheckBuffer(args[0]) || !PyLong_CheckExact(args[1]) ||
        !PyDict_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "decode(buffer: bytes, offset: int, specs: dict)");
        return NULL;
    }
    if (data_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "decode: setup() was not called");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "decode: negative offset");
        }
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *result;
    if (view.len - offset < 6) { /* kind, relation OID, tuple marker */
        result = Py_NewRef(Py_None);
    } else {
        result = decode_at((const unsigned char *)view.buf + offset, view.len - offset, args[2]);
    }
    PyBuffer_Release(&view);
    return result;
}

/* The message of ``size`` bytes at ``buf`` (at least 6). */
static PyObject *decode_at(const unsigned char *buf, Py_ssize_t size, PyObject *specs) {
    unsigned char kind = buf[0], marker = buf[5];
    if (kind == 'B') {
        return begin_message(buf, size);
    }
    if (kind == 'C') {
        return commit_message(buf, size);
    }
    if (kind != 'I' && kind != 'U' && kind != 'D') {
        Py_RETURN_NONE;
    }
    PyObject *oid = PyLong_FromUnsignedLong((uint32_t)read_be32(buf + 1));
    if (oid == NULL) {
        return NULL;
    }
    PyObject *spec = PyDict_GetItemWithError(specs, oid); /* borrowed */
    Py_DECREF(oid);
    if (spec == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE; /* before its Relation: the Python path says so */
    }
    if (!PyTuple_CheckExact(spec) || PyTuple_GET_SIZE(spec) != 5) {
        PyErr_SetString(PyExc_TypeError, "decode: a relation spec is not a 5-tuple");
        return NULL;
    }
    relation rel;
    rel.json = PyTuple_GET_ITEM(spec, 0);
    rel.names = PyTuple_GET_ITEM(spec, 1);
    rel.parsers = PyTuple_GET_ITEM(spec, 2);
    PyObject *kinds = PyTuple_GET_ITEM(spec, 3);
    rel.key_indexes = PyTuple_GET_ITEM(spec, 4);
    if (!PyTuple_CheckExact(rel.names) || !PyTuple_CheckExact(rel.parsers) ||
        !PyBytes_CheckExact(kinds) || !PyTuple_CheckExact(rel.key_indexes) ||
        PyTuple_GET_SIZE(rel.parsers) != PyTuple_GET_SIZE(rel.names) ||
        PyBytes_GET_SIZE(kinds) != PyTuple_GET_SIZE(rel.names)) {
        PyErr_SetString(PyExc_TypeError, "decode: malformed relation spec");
        return NULL;
    }
    rel.kinds = PyBytes_AS_STRING(kinds);
    rel.ncols = PyTuple_GET_SIZE(rel.names);

    Py_ssize_t pos = 6;
    PyObject *first = NULL, *second = NULL;
    PyObject *b = NULL;
    step s;
    if (kind == 'I' && marker == 'N') {
        s = read_tuple(buf, size, &pos, &first);
        PyObject *row = NULL;
        if (s == OK && pos == size) {
            s = make_row(&rel, first, NULL, &row);
            if (s == OK) {
                PyObject *keys[1] = {s_new}, *values[1] = {row};
                b = body(s_insert, rel.json, 1, keys, values);
            }
        } else if (s == OK) {
            s = FALLBACK;
        }
        Py_XDECREF(first);
        return result(s, s_insert, b);
    }
    if (kind == 'U' && (marker == 'N' || marker == 'K' || marker == 'O')) {
        s = read_tuple(buf, size, &pos, &first);
        if (s == OK && marker != 'N') {
            /* the old tuple was first; then the new tuple's marker */
            if (pos < size && buf[pos] == 'N') {
                pos += 1;
                s = read_tuple(buf, size, &pos, &second);
            } else {
                s = FALLBACK;
            }
        }
        if (s == OK && pos != size) {
            s = FALLBACK;
        }
        PyObject *old = NULL, *key = NULL, *new = NULL;
        if (s == OK) {
            PyObject *new_values = marker == 'N' ? first : second;
            if (marker == 'O') {
                s = make_row(&rel, first, NULL, &old);
                key = old;
            } else if (marker == 'K') {
                s = make_key(&rel, first, &key);
            }
            if (s == OK) {
                s = make_row(&rel, new_values, old, &new);
            }
            if (s == OK) {
                PyObject *keys[3] = {s_key, s_old, s_new};
                PyObject *values[3] = {key ? Py_NewRef(key) : Py_NewRef(Py_None),
                                       old ? Py_NewRef(old) : Py_NewRef(Py_None), new};
                b = body(s_update, rel.json, 3, keys, values);
            }
            /* key is old for 'O' (one reference); its own for 'K' */
            if (marker == 'K') {
                Py_XDECREF(key);
            }
            Py_XDECREF(old);
        }
        Py_XDECREF(first);
        Py_XDECREF(second);
        return result(s, s_update, b);
    }
    if (kind == 'D' && (marker == 'K' || marker == 'O')) {
        s = read_tuple(buf, size, &pos, &first);
        if (s == OK && pos != size) {
            s = FALLBACK;
        }
        if (s == OK) {
            PyObject *key = NULL;
            if (marker == 'O') {
                s = make_row(&rel, first, NULL, &key);
                if (s == OK) {
                    PyObject *keys[2] = {s_key, s_old};
                    PyObject *values[2] = {Py_NewRef(key), key};
                    b = body(s_delete, rel.json, 2, keys, values);
                }
            } else {
                s = make_key(&rel, first, &key);
                if (s == OK) {
                    PyObject *keys[2] = {s_key, s_old};
                    PyObject *values[2] = {key, Py_NewRef(Py_None)};
                    b = body(s_delete, rel.json, 2, keys, values);
                }
            }
        }
        Py_XDECREF(first);
        return result(s, s_delete, b);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, "setup(Data, UNCHANGED_TOAST, Begin, Commit): the types decode builds."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL,
     "decode(buffer, offset, specs) -> Data | Begin | Commit | None: one pgoutput I/U/D/B/C message mapped."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pgrows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pgrows(void) { return PyModule_Create(&module); }
