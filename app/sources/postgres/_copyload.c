/* An initial sync's COPY rows, read from libpq and inserted into the SQLite replica,
 * a batch per call and without the GIL.
 *
 * app/sources/postgres/copy_load.py documents the contract (Loader.load) and holds
 * the pure-Python twin, which reads the same rows through psycopg, parses them with
 * copy_text.parse_copy_line and inserts them with executemany.
 * tests/sources/postgres/test_copy_load.py compares the two on real COPY output,
 * on awkward text and on broken rows.
 *
 * Per row the twin costs a Python object for the row's bytes, a str, a list of
 * fields and the sqlite3 module's binding (~3.5 us a row on the bench machine, one
 * core); this loop costs libpq's copy and SQLite's insert (~1.5 us), and leaves the
 * GIL to the rest of the process while it runs.
 *
 * One copy of each library.  The libpq and SQLite functions are not linked in: they
 * are the ones the process already uses, passed to setup() as addresses that
 * copy_load.py resolves through psycopg's and the sqlite3 module's own shared
 * objects.  A second SQLite in the process would break SQLite's POSIX locks (closing
 * one copy's file descriptor drops the other's locks), and a PGconn belongs to the
 * libpq that made it.  The declarations below are the stable C ABI of both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct sqlite3 sqlite3;
typedef struct sqlite3_stmt sqlite3_stmt;
typedef struct pg_conn PGconn;

#define SQLITE_OK 0
#define SQLITE_CONSTRAINT 19
#define SQLITE_DONE 101
#define SQLITE_OPEN_READWRITE 0x00000002
#define SQLITE_OPEN_NOMUTEX 0x00008000
#define SQLITE_STATIC ((void (*)(void *))0)

static struct {
    int (*sqlite3_open_v2)(const char *, sqlite3 **, int, const char *);
    int (*sqlite3_close_v2)(sqlite3 *);
    int (*sqlite3_prepare_v2)(sqlite3 *, const char *, int, sqlite3_stmt **, const char **);
    int (*sqlite3_finalize)(sqlite3_stmt *);
    int (*sqlite3_bind_text)(sqlite3_stmt *, int, const char *, int, void (*)(void *));
    int (*sqlite3_bind_blob)(sqlite3_stmt *, int, const void *, int, void (*)(void *));
    int (*sqlite3_bind_int64)(sqlite3_stmt *, int, long long);
    int (*sqlite3_bind_double)(sqlite3_stmt *, int, double);
    int (*sqlite3_bind_null)(sqlite3_stmt *, int);
    int (*sqlite3_step)(sqlite3_stmt *);
    int (*sqlite3_reset)(sqlite3_stmt *);
    int (*sqlite3_exec)(sqlite3 *, const char *, void *, void *, char **);
    const char *(*sqlite3_errmsg)(sqlite3 *);
    int (*sqlite3_extended_errcode)(sqlite3 *);
    int (*sqlite3_busy_timeout)(sqlite3 *, int);
    int (*PQgetCopyData)(PGconn *, char **, int);
    void (*PQfreemem)(void *);
} api;

/* The names setup() reads, in the order of api's members. */
static const char *api_names[] = {
    "sqlite3_open_v2",   "sqlite3_close_v2",    "sqlite3_prepare_v2",
    "sqlite3_finalize",  "sqlite3_bind_text",   "sqlite3_bind_blob",
    "sqlite3_bind_int64", "sqlite3_bind_double", "sqlite3_bind_null",
    "sqlite3_step",      "sqlite3_reset",       "sqlite3_exec",
    "sqlite3_errmsg",    "sqlite3_extended_errcode", "sqlite3_busy_timeout",
    "PQgetCopyData",     "PQfreemem",
};
#define N_API (sizeof api_names / sizeof api_names[0])

static int api_ready = 0;
static PyObject *format_error = NULL;    /* copy_text.CopyFormatError */
static PyObject *integrity_error = NULL; /* sqlite3.IntegrityError */
static PyObject *operational_error = NULL; /* sqlite3.OperationalError */

static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *addresses, *fmt, *integrity, *operational;
    if (!PyArg_ParseTuple(args, "O!OOO:setup", &PyDict_Type, &addresses, &fmt, &integrity,
                          &operational)) {
        return NULL;
    }
    void *found[N_API];
    for (size_t i = 0; i < N_API; i++) {
        PyObject *address = PyDict_GetItemString(addresses, api_names[i]);
        if (address == NULL) {
            PyErr_Format(PyExc_KeyError, "setup: no address for %s", api_names[i]);
            return NULL;
        }
        found[i] = PyLong_AsVoidPtr(address);
        if (found[i] == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "setup: a null address for %s", api_names[i]);
            }
            return NULL;
        }
    }
    _Static_assert(sizeof api == N_API * sizeof(void *), "api and api_names differ");
    memcpy(&api, found, sizeof api);
    Py_INCREF(fmt);
    Py_INCREF(integrity);
    Py_INCREF(operational);
    Py_XSETREF(format_error, fmt);
    Py_XSETREF(integrity_error, integrity);
    Py_XSETREF(operational_error, operational);
    api_ready = 1;
    Py_RETURN_NONE;
}

static PyObject *api_names_tuple(PyObject *self, PyObject *noargs) {
    PyObject *names = PyTuple_New(N_API);
    if (names == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < N_API; i++) {
        PyObject *name = PyUnicode_FromString(api_names[i]);
        if (name == NULL) {
            Py_DECREF(names);
            return NULL;
        }
        PyTuple_SET_ITEM(names, i, name);
    }
    return names;
}

/* -- one row ---------------------------------------------------------------- */

/* Strict UTF-8, as Python's decoder has it (no overlongs, surrogates or > U+10FFFF). */
static int valid_utf8(const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int more;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
            more = 1;
        } else if (c == 0xE0) {
            more = 2, lo = 0xA0;
        } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
            more = 2;
        } else if (c == 0xED) {
            more = 2, hi = 0x9F;
        } else if (c == 0xF0) {
            more = 3, lo = 0x90;
        } else if (c >= 0xF1 && c <= 0xF3) {
            more = 3;
        } else if (c == 0xF4) {
            more = 3, hi = 0x8F;
        } else {
            return 0;
        }
        if (i + more >= n) {
            return 0; /* cut short */
        }
        if (s[i + 1] < lo || s[i + 1] > hi) {
            return 0;
        }
        for (int k = 2; k <= more; k++) {
            if ((s[i + k] & 0xC0) != 0x80) {
                return 0;
            }
        }
        i += more + 1;
    }
    return 1;
}

static int all_ascii(const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        if (w & UINT64_C(0x8080808080808080)) {
            return 0;
        }
    }
    for (; i < n; i++) {
        if (s[i] & 0x80) {
            return 0;
        }
    }
    return 1;
}

static int octal(char c) { return c >= '0' && c <= '7'; }

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The field s[0:n] (it holds a backslash) unescaped into out (n bytes are enough);
 * its length.  *made_bytes is set when an octal or hex escape made a byte, which
 * may not be UTF-8.  The rules are copy_text's: a backslash before an octal digit
 * takes up to three, before x and a hex digit up to two, before b f n r t v their
 * control character and before anything else that character; a backslash that
 * ends the field stays. */
static Py_ssize_t unescape(const char *s, Py_ssize_t n, char *out, int *made_bytes) {
    Py_ssize_t o = 0;
    for (Py_ssize_t i = 0; i < n;) {
        char c = s[i];
        if (c != '\\' || i + 1 == n) {
            out[o++] = c;
            i++;
            continue;
        }
        char e = s[i + 1];
        if (octal(e)) {
            int v = 0, k = 0;
            while (k < 3 && i + 1 + k < n && octal(s[i + 1 + k])) {
                v = v * 8 + (s[i + 1 + k] - '0');
                k++;
            }
            out[o++] = (char)(v & 0xFF);
            *made_bytes = 1;
            i += 1 + k;
        } else if (e == 'x' && i + 2 < n && hexval(s[i + 2]) >= 0) {
            int v = hexval(s[i + 2]), k = 1;
            if (i + 3 < n && hexval(s[i + 3]) >= 0) {
                v = v * 16 + hexval(s[i + 3]);
                k = 2;
            }
            out[o++] = (char)v;
            *made_bytes = 1;
            i += 2 + k;
        } else {
            switch (e) {
            case 'b': out[o++] = '\b'; break;
            case 'f': out[o++] = '\f'; break;
            case 'n': out[o++] = '\n'; break;
            case 'r': out[o++] = '\r'; break;
            case 't': out[o++] = '\t'; break;
            case 'v': out[o++] = '\v'; break;
            default: out[o++] = e;
            }
            i += 2;
        }
    }
    return o;
}

enum { ROW_OK = 0, ROW_FIELDS = 1, ROW_NOT_UTF8 = 2, ROW_FIELD_NOT_UTF8 = 3 };

typedef struct {
    PyObject_HEAD
    sqlite3 *db;
    sqlite3_stmt *stmt;
    Py_ssize_t ncols;
    PyObject *converters; /* tuple: a callable, or None where the text is bound as it is */
    int has_converters;
    const char **field;   /* this row's fields: pointers into the line or scratch */
    int *length;          /* -1 for NULL */
    PyObject **held;      /* converted values, alive until their row's step */
    char *scratch;        /* unescaped fields */
    Py_ssize_t scratch_size;
} Loader;

/* Splits line[0:n] into the loader's fields.  ROW_OK, or why not (*detail: the
 * number of fields found, or the index of the field that is not UTF-8). */
static int split_row(Loader *self, const char *line, Py_ssize_t n, Py_ssize_t *detail) {
    if (n > 0 && line[n - 1] == '\n') {
        n--;
    }
    /* In copy_text's order: the row as UTF-8, then its fields. */
    if (!all_ascii((const unsigned char *)line, n) && !valid_utf8((const unsigned char *)line, n)) {
        return ROW_NOT_UTF8;
    }
    Py_ssize_t tabs = 0;
    for (const char *p = line, *end = line + n; (p = memchr(p, '\t', end - p)) != NULL; p++) {
        tabs++;
    }
    if (tabs + 1 != self->ncols) {
        *detail = tabs + 1;
        return ROW_FIELDS;
    }
    if (n > self->scratch_size) {
        char *bigger = PyMem_RawRealloc(self->scratch, n);
        if (bigger == NULL) {
            *detail = -1;
            return ROW_FIELDS; /* reported as MemoryError by the caller */
        }
        self->scratch = bigger;
        self->scratch_size = n;
    }
    char *out = self->scratch;
    const char *start = line, *end = line + n;
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        const char *stop = memchr(start, '\t', end - start);
        if (stop == NULL) {
            stop = end;
        }
        Py_ssize_t len = stop - start;
        if (memchr(start, '\\', len) == NULL) {
            self->field[i] = start;
            self->length[i] = (int)len;
        } else if (len == 2 && start[1] == 'N') {
            self->field[i] = NULL;
            self->length[i] = -1;
        } else {
            int made_bytes = 0;
            Py_ssize_t m = unescape(start, len, out, &made_bytes);
            if (made_bytes && !valid_utf8((const unsigned char *)out, m)) {
                *detail = i;
                return ROW_FIELD_NOT_UTF8;
            }
            self->field[i] = out;
            self->length[i] = (int)m;
            out += m;
        }
        start = stop + 1;
    }
    return ROW_OK;
}

/* -- binding ---------------------------------------------------------------- */

static void release_held(Loader *self) {
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        Py_CLEAR(self->held[i]);
    }
}

static int bind_text_fields(Loader *self) {
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        if (self->has_converters && PyTuple_GET_ITEM(self->converters, i) != Py_None) {
            continue;
        }
        int rc = self->length[i] < 0
                     ? api.sqlite3_bind_null(self->stmt, (int)i + 1)
                     : api.sqlite3_bind_text(self->stmt, (int)i + 1, self->field[i],
                                             self->length[i], SQLITE_STATIC);
        if (rc != SQLITE_OK) {
            return rc;
        }
    }
    return SQLITE_OK;
}

/* With the GIL: the converted columns, each value held until the row's step.
 * -1 with a Python error set, or a SQLite result code. */
static int bind_converted(Loader *self) {
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        PyObject *convert = PyTuple_GET_ITEM(self->converters, i);
        if (convert == Py_None) {
            continue;
        }
        int column = (int)i + 1, rc;
        if (self->length[i] < 0) {
            rc = api.sqlite3_bind_null(self->stmt, column);
        } else {
            PyObject *text = PyUnicode_DecodeUTF8(self->field[i], self->length[i], NULL);
            if (text == NULL) {
                return -1;
            }
            PyObject *value = PyObject_CallOneArg(convert, text);
            Py_DECREF(text);
            if (value == NULL) {
                return -1;
            }
            self->held[i] = value;
            if (value == Py_None) {
                rc = api.sqlite3_bind_null(self->stmt, column);
            } else if (PyLong_Check(value)) {
                int overflow = 0;
                long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
                if (overflow) {
                    PyErr_SetString(PyExc_OverflowError,
                                    "Python int too large to convert to SQLite INTEGER");
                    return -1;
                }
                if (v == -1 && PyErr_Occurred()) {
                    return -1;
                }
                rc = api.sqlite3_bind_int64(self->stmt, column, v);
            } else if (PyFloat_Check(value)) {
                rc = api.sqlite3_bind_double(self->stmt, column, PyFloat_AS_DOUBLE(value));
            } else if (PyUnicode_Check(value)) {
                Py_ssize_t size;
                const char *utf8 = PyUnicode_AsUTF8AndSize(value, &size);
                if (utf8 == NULL) {
                    return -1;
                }
                rc = api.sqlite3_bind_text(self->stmt, column, utf8, (int)size, SQLITE_STATIC);
            } else if (PyBytes_Check(value)) {
                rc = api.sqlite3_bind_blob(self->stmt, column, PyBytes_AS_STRING(value),
                                           (int)PyBytes_GET_SIZE(value), SQLITE_STATIC);
            } else {
                PyErr_Format(PyExc_TypeError,
                             "Error binding parameter %d: type '%s' is not supported", column,
                             Py_TYPE(value)->tp_name);
                return -1;
            }
        }
        if (rc != SQLITE_OK) {
            return rc;
        }
    }
    return SQLITE_OK;
}

/* -- the loader --------------------------------------------------------------- */

static void loader_close_db(Loader *self) {
    if (self->stmt != NULL) {
        api.sqlite3_finalize(self->stmt);
        self->stmt = NULL;
    }
    if (self->db != NULL) {
        api.sqlite3_close_v2(self->db);
        self->db = NULL;
    }
}

static int raise_sqlite(sqlite3 *db, int rc, const char *doing) {
    int code = db != NULL ? api.sqlite3_extended_errcode(db) : rc;
    const char *message = db != NULL ? api.sqlite3_errmsg(db) : "out of memory";
    PyErr_Format((code & 0xFF) == SQLITE_CONSTRAINT ? integrity_error : operational_error,
                 "%s: %s", doing, message);
    return -1;
}

static void loader_dealloc(Loader *self) {
    loader_close_db(self);
    if (self->held != NULL) {
        release_held(self);
    }
    Py_XDECREF(self->converters);
    PyMem_Free(self->field);
    PyMem_Free(self->length);
    PyMem_Free(self->held);
    PyMem_RawFree(self->scratch);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int loader_init(Loader *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "insert", "converters", "busy_timeout_ms", NULL};
    PyObject *path_obj;
    const char *insert;
    PyObject *converters;
    int busy_timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&sO!i:Loader", kwlist, PyUnicode_FSConverter,
                                     &path_obj, &insert, &PyTuple_Type, &converters,
                                     &busy_timeout_ms)) {
        return -1;
    }
    if (!api_ready) {
        Py_DECREF(path_obj);
        PyErr_SetString(PyExc_RuntimeError, "Loader: setup() has not run");
        return -1;
    }
    if (self->db != NULL || self->field != NULL) {
        Py_DECREF(path_obj);
        PyErr_SetString(PyExc_RuntimeError, "Loader: already initialised");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(converters);
    if (n < 1) {
        Py_DECREF(path_obj);
        PyErr_SetString(PyExc_ValueError, "Loader: a table has at least one column");
        return -1;
    }
    self->ncols = n;
    Py_INCREF(converters);
    self->converters = converters;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyTuple_GET_ITEM(converters, i) != Py_None) {
            self->has_converters = 1;
        }
    }
    self->field = PyMem_Calloc(n, sizeof *self->field);
    self->length = PyMem_Calloc(n, sizeof *self->length);
    self->held = PyMem_Calloc(n, sizeof *self->held);
    if (self->field == NULL || self->length == NULL || self->held == NULL) {
        Py_DECREF(path_obj);
        PyErr_NoMemory();
        return -1;
    }
    const char *path = PyBytes_AS_STRING(path_obj);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = api.sqlite3_open_v2(path, &self->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc == SQLITE_OK) {
        api.sqlite3_busy_timeout(self->db, busy_timeout_ms);
        /* The staging file is discarded on failure; the sync's last commit makes it
         * durable (initial_sync._commit). */
        rc = api.sqlite3_exec(self->db, "PRAGMA synchronous = OFF", NULL, NULL, NULL);
    }
    if (rc == SQLITE_OK) {
        rc = api.sqlite3_prepare_v2(self->db, insert, -1, &self->stmt, NULL);
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(path_obj);
    if (rc != SQLITE_OK) {
        raise_sqlite(self->db, rc, "Loader");
        loader_close_db(self);
        return -1;
    }
    return 0;
}

/* With the GIL: the CopyFormatError for a row split_row refused, worded as
 * copy_text.parse_copy_line words it. */
static void raise_row_error(Loader *self, int row_error, Py_ssize_t detail, const char *line,
                            Py_ssize_t size) {
    if (detail == -1 || line == NULL) {
        PyErr_NoMemory();
        return;
    }
    PyObject *text = PyUnicode_DecodeUTF8(line, size, "replace");
    if (text == NULL) {
        return;
    }
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    if (length > 0 && PyUnicode_READ_CHAR(text, length - 1) == '\n') {
        length--;
    }
    PyObject *shown = NULL;
    if (row_error == ROW_FIELD_NOT_UTF8) {
        /* The field as it was sent. */
        PyObject *fields = PyUnicode_Substring(text, 0, length);
        PyObject *tab = fields != NULL ? PyUnicode_FromString("\t") : NULL;
        PyObject *parts = tab != NULL ? PyUnicode_Split(fields, tab, -1) : NULL;
        if (parts != NULL && detail < PyList_GET_SIZE(parts)) {
            shown = PyUnicode_Substring(PyList_GET_ITEM(parts, detail), 0, 200);
        }
        Py_XDECREF(parts);
        Py_XDECREF(tab);
        Py_XDECREF(fields);
    } else {
        shown = PyUnicode_Substring(text, 0, length < 200 ? length : 200);
    }
    Py_DECREF(text);
    if (shown == NULL) {
        return;
    }
    if (row_error == ROW_FIELDS) {
        PyErr_Format(format_error, "COPY row has %zd fields, expected %zd: %R", detail, self->ncols,
                     shown);
    } else if (row_error == ROW_NOT_UTF8) {
        PyErr_Format(format_error, "COPY row is not UTF-8: %R", shown);
    } else {
        PyErr_Format(format_error, "COPY field is not UTF-8 after unescaping: %R", shown);
    }
    Py_DECREF(shown);
}

/* parse_line(line) -> list[str | None]: one row split as load() splits it, for the
 * tests that hold it to copy_text.parse_copy_line (and the fuzz target). */
static PyObject *loader_parse_line(Loader *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_ssize_t detail = 0;
    int row_error = split_row(self, view.buf, view.len, &detail);
    PyObject *result = NULL;
    if (row_error != ROW_OK) {
        raise_row_error(self, row_error, detail, view.buf, view.len);
    } else if ((result = PyList_New(self->ncols)) != NULL) {
        for (Py_ssize_t i = 0; i < self->ncols; i++) {
            PyObject *value = self->length[i] < 0
                                  ? Py_NewRef(Py_None)
                                  : PyUnicode_DecodeUTF8(self->field[i], self->length[i], NULL);
            if (value == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, i, value);
        }
    }
    PyBuffer_Release(&view);
    return result;
}

/* load(pgconn, max_bytes) -> (rows, bytes, state). */
static PyObject *loader_load(Loader *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "load(pgconn, max_bytes)");
        return NULL;
    }
    if (self->stmt == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "load: the loader is closed");
        return NULL;
    }
    PyObject *pointer = PyObject_GetAttrString(args[0], "pgconn_ptr");
    if (pointer == NULL) {
        return NULL;
    }
    PGconn *conn = PyLong_AsVoidPtr(pointer);
    Py_DECREF(pointer);
    if (conn == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "load: the connection is closed");
        }
        return NULL;
    }
    Py_ssize_t max_bytes = PyLong_AsSsize_t(args[1]);
    if (max_bytes == -1 && PyErr_Occurred()) {
        return NULL;
    }

    long long rows = 0, bytes = 0;
    int state = 0;        /* 0 more rows, 1 the COPY ended, 2 the COPY failed */
    int sqlite_rc = SQLITE_OK;
    const char *doing = NULL;
    int row_error = ROW_OK;
    Py_ssize_t detail = 0;
    char *bad_line = NULL; /* a copy of a row that does not parse, for its message */
    Py_ssize_t bad_size = 0;
    int python_error = 0;

    /* Without converters the whole batch runs without the GIL; with them the GIL is
     * taken for each row's conversion and given up for its step. */
    PyThreadState *ts = PyEval_SaveThread();
    sqlite_rc = api.sqlite3_exec(self->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (sqlite_rc != SQLITE_OK) {
        doing = "BEGIN";
    }
    while (sqlite_rc == SQLITE_OK) {
        char *line = NULL;
        int n = api.PQgetCopyData(conn, &line, 0);
        if (n == -1) {
            state = 1;
            break;
        }
        if (n < 0 || line == NULL) {
            state = 2;
            break;
        }
        bytes += n;
        row_error = split_row(self, line, n, &detail);
        if (row_error != ROW_OK) {
            bad_line = PyMem_RawMalloc(n > 0 ? n : 1);
            if (bad_line != NULL) {
                memcpy(bad_line, line, n);
                bad_size = n;
            }
            api.PQfreemem(line);
            break;
        }
        sqlite_rc = bind_text_fields(self);
        if (sqlite_rc == SQLITE_OK && self->has_converters) {
            PyEval_RestoreThread(ts);
            release_held(self); /* the previous row's */
            int rc = bind_converted(self);
            if (rc < 0) {
                python_error = 1;
                api.PQfreemem(line);
                break; /* with the GIL */
            }
            ts = PyEval_SaveThread();
            sqlite_rc = rc;
        }
        if (sqlite_rc == SQLITE_OK) {
            sqlite_rc = api.sqlite3_step(self->stmt);
            api.sqlite3_reset(self->stmt);
            sqlite_rc = sqlite_rc == SQLITE_DONE ? SQLITE_OK : sqlite_rc;
        }
        api.PQfreemem(line);
        if (sqlite_rc != SQLITE_OK) {
            doing = "INSERT";
            break;
        }
        rows++;
        if (bytes >= max_bytes) {
            break;
        }
    }
    if (python_error) {
        /* With the GIL, and the converter's exception set. */
        api.sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL);
        release_held(self);
        PyMem_RawFree(bad_line);
        return NULL;
    }
    /* The SQLite error's message is kept before ROLLBACK can replace it. */
    char message[512] = "";
    int code = SQLITE_OK;
    if (sqlite_rc == SQLITE_OK && row_error == ROW_OK && state != 2) {
        sqlite_rc = api.sqlite3_exec(self->db, "COMMIT", NULL, NULL, NULL);
        doing = "COMMIT";
    }
    if (sqlite_rc != SQLITE_OK) {
        code = api.sqlite3_extended_errcode(self->db);
        snprintf(message, sizeof message, "%s: %s", doing, api.sqlite3_errmsg(self->db));
    }
    if (sqlite_rc != SQLITE_OK || row_error != ROW_OK || state == 2) {
        api.sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL);
        rows = 0;
    }
    PyEval_RestoreThread(ts);
    release_held(self);
    if (sqlite_rc != SQLITE_OK) {
        PyMem_RawFree(bad_line);
        PyErr_SetString((code & 0xFF) == SQLITE_CONSTRAINT ? integrity_error : operational_error,
                        message);
        return NULL;
    }
    if (row_error != ROW_OK) {
        raise_row_error(self, row_error, detail, bad_line, bad_size);
        PyMem_RawFree(bad_line);
        return NULL;
    }
    return Py_BuildValue("(LLi)", rows, bytes, state);
}

static PyObject *loader_close(Loader *self, PyObject *noargs) {
    Py_BEGIN_ALLOW_THREADS
    loader_close_db(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef loader_methods[] = {
    {"load", (PyCFunction)(void (*)(void))loader_load, METH_FASTCALL,
     "load(pgconn, max_bytes) -> (rows, bytes, state): COPY rows inserted in one transaction."},
    {"close", (PyCFunction)loader_close, METH_NOARGS, "close(): the SQLite connection closed."},
    {"parse_line", (PyCFunction)loader_parse_line, METH_O,
     "parse_line(line) -> list[str | None]: one COPY row split as load() splits it."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LoaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "app.sources.postgres._copyload.Loader",
    .tp_basicsize = sizeof(Loader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Loader(path, insert, converters, busy_timeout_ms): a table's COPY rows into SQLite.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)loader_init,
    .tp_dealloc = (destructor)loader_dealloc,
    .tp_methods = loader_methods,
};

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(addresses, CopyFormatError, IntegrityError, OperationalError): the functions to call."},
    {"api_names", api_names_tuple, METH_NOARGS, "api_names() -> the function names setup() needs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copyload", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copyload(void) {
    if (PyType_Ready(&LoaderType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&LoaderType);
    if (PyModule_AddObject(m, "Loader", (PyObject *)&LoaderType) < 0) {
        Py_DECREF(&LoaderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
