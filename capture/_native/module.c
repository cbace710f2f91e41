/* The Python module _capture_native: configure, decode_chunk, decode_block, content_hashes, range_hashes,
 * parse_times, redact_gate, redact_gate_json, digests_add_new, digests_contains, digests_rehash, blake2b16_many. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "blake2b.h"
#include "capture.h"
#include "digests.h"
#include "gate.h"

static PyObject *bytes_of(const Buf *b) { return PyBytes_FromStringAndSize((const char *)b->data, (Py_ssize_t)b->len); }

/* A decoded column's buffer handed to Python as it is: a read-only buffer object that owns the
 * memory the decoder grew and frees it when pyarrow drops the last reference. A column is as
 * large as the text it holds, and copying it into a bytes object (then faulting in and zeroing
 * that copy's pages) cost a worker more CPU than the redaction gate. */
typedef struct {
    PyObject_HEAD
    uint8_t *data;
    Py_ssize_t len;
} Owned;

static int owned_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    static uint8_t empty[1];
    Owned *o = (Owned *)self;
    return PyBuffer_FillInfo(view, self, o->data ? o->data : empty, o->len, 1, flags);
}

static Py_ssize_t owned_length(PyObject *self) { return ((Owned *)self)->len; }

static void owned_dealloc(PyObject *self) {
    free(((Owned *)self)->data);
    Py_TYPE(self)->tp_free(self);
}

static PyBufferProcs owned_as_buffer = {.bf_getbuffer = owned_getbuffer};
static PySequenceMethods owned_as_sequence = {.sq_length = owned_length};

static PyTypeObject OwnedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_capture_native.Owned",
    .tp_doc = "A read-only buffer of decoded bytes that the decoder handed over (no copy).",
    .tp_basicsize = sizeof(Owned),
    .tp_dealloc = owned_dealloc,
    .tp_as_buffer = &owned_as_buffer,
    .tp_as_sequence = &owned_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

/* b's memory as an Owned object; b is left empty (its owner's free is then a no-op for it). */
static PyObject *take_buf(Buf *b) {
    Owned *o = PyObject_New(Owned, &OwnedType);
    if (o == NULL)
        return NULL;
    o->data = b->data;
    o->len = (Py_ssize_t)b->len;
    b->data = NULL;
    b->len = b->cap = 0;
    return (PyObject *)o;
}

/* (offsets, data, validity or None, null count) of a utf8 column. */
static PyObject *str_col_tuple(StrCol *c) {
    PyObject *validity = c->nulls ? take_buf(&c->validity) : Py_NewRef(Py_None);
    return Py_BuildValue("(NNNL)", take_buf(&c->offsets), take_buf(&c->data), validity, (long long)c->nulls);
}

/* (values, validity or None, null count) of a fixed-width column. */
static PyObject *fixed_col_tuple(FixedCol *c) {
    PyObject *validity = c->nulls ? take_buf(&c->validity) : Py_NewRef(Py_None);
    return Py_BuildValue("(NNL)", take_buf(&c->values), validity, (long long)c->nulls);
}

/* (offsets, values, validity or None, null count) of a list<int32> column. */
static PyObject *ids_col_tuple(IdsCol *c) {
    PyObject *validity = c->nulls ? take_buf(&c->validity) : Py_NewRef(Py_None);
    return Py_BuildValue("(NNNL)", take_buf(&c->offsets), take_buf(&c->values), validity, (long long)c->nulls);
}

static PyObject *columns_dict(Columns *c, PyObject *declined, long long skips) {
    PyObject *d = Py_BuildValue(
        "{s:L,s:L,s:L,s:O,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N}", "rows", (long long)c->rows, "turns",
        (long long)c->turns, "skips", skips, "declined", declined, "index", take_buf(&c->index), "conv_offsets",
        take_buf(&c->conv_offsets), "from", str_col_tuple(&c->from), "value", str_col_tuple(&c->value), "event_id",
        str_col_tuple(&c->event_id), "inference_id", str_col_tuple(&c->inference_id), "inference_time",
        str_col_tuple(&c->inference_time), "model", str_col_tuple(&c->model), "format", str_col_tuple(&c->format),
        "finish_reason", str_col_tuple(&c->finish_reason), "raw", take_buf(&c->raw), "temperature", fixed_col_tuple(&c->temperature), "top_p",
        fixed_col_tuple(&c->top_p), "max_tokens", fixed_col_tuple(&c->max_tokens));
    if (d == NULL)
        return NULL;
    struct { const char *name; PyObject *v; } more[] = {
        {"messages", str_col_tuple(&c->messages)}, {"tools", str_col_tuple(&c->tools)},
        {"tool_choice", str_col_tuple(&c->tool_choice)}, {"chat_template_kwargs", str_col_tuple(&c->chat_template_kwargs)},
        {"prompt_token_ids", ids_col_tuple(&c->prompt_token_ids)}, {"output_token_ids", ids_col_tuple(&c->output_token_ids)}};
    int failed = 0;
    for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) {
        if (more[i].v == NULL || PyDict_SetItemString(d, more[i].name, more[i].v) < 0)
            failed = 1;
        Py_XDECREF(more[i].v);
    }
    if (failed) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* Rows are decoded into a group of GROUP before they are hashed (side by side, see
 * blake2b16_many) and added to the columns in line order. */
#define GROUP 8

/* The state of one decode call: the rows' columns, the lines declined, the tabular ones counted. */
typedef struct {
    Columns cols;
    Row rows[GROUP];       /* decoded, not yet added */
    int64_t index[GROUP];  /* their line indices */
    Buf serialized[GROUP]; /* what content_hash hashes of each */
    int pending;
    PyObject *declined; /* list of int: indices of the lines left to the Python paths */
    long long skips;
    Py_ssize_t max_line;
    /* In-file dedupe (decode_block with a table): the rows' content hashes (32 hex each), the
     * digest table of the rows kept so far, how many more it may take, and the rows dropped. */
    uint8_t *table;
    size_t slots, room, inserted, unchecked; /* unchecked: rows kept without going into the table */
    int hour_known;
    Buf hashes;
    long long duplicates;
} Decoder;

static int row_serialize(const Row *row, Buf *out);
static void hex_digest(const uint8_t digest[16], char *out);

static int not_configured(void) {
    PyErr_SetString(PyExc_RuntimeError, "the native capture decoder has no rules: call configure(capture.rules.native_table())");
    return -1;
}

static int decoder_init(Decoder *d, Py_ssize_t max_line) {
    memset(d, 0, sizeof *d);
    d->max_line = max_line;
    if (!RULES.configured)
        return not_configured();
    if ((d->declined = PyList_New(0)) == NULL)
        return -1;
    if (columns_init(&d->cols) != J_OK) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void decoder_free(Decoder *d) {
    buf_free(&d->hashes);
    Py_XDECREF(d->declined);
    columns_free(&d->cols);
    for (int i = 0; i < GROUP; i++) {
        row_free(&d->rows[i]);
        buf_free(&d->serialized[i]);
    }
}

static int no_memory(void) {
    /* Out of memory, or a chunk beyond Arrow's 2 GiB string offsets. */
    PyErr_SetString(PyExc_MemoryError, "native decode: out of memory or chunk too large");
    return -1;
}

/* Whether the row with this digest is a copy to drop (else it may go into the table). */
static int decoder_is_copy(Decoder *d, const Row *row, const uint8_t digest[16]) {
    /* Only a row sure to be kept may stand for later copies: one whose time Python will not
     * quarantine (a canonical inferenceTime, or the layout hour to fall back on). */
    int64_t us;
    const Span *t = &row->inference_time;
    /* A row kept exactly is keyed by its turns and exchange (row_serialize), as ingest keys it:
     * a copy of a plain row's turns is a different digest, so the one table serves both. */
    if (d->hour_known || (t->ptr != NULL && canonical_time(t->ptr, t->len, &us))) {
        /* Once `room` is used up, copies of the rows in the table are still dropped. */
        int added = d->inserted < d->room ? digests_add(d->table, d->slots, digest)
                                          : !digests_contains(d->table, d->slots, digest) ? 2 : 0;
        if (added == 0) {
            d->duplicates++;
            return 1;
        }
        d->inserted += added == 1;
        d->unchecked += added != 1;
    } else {
        d->unchecked++;
    }
    return 0;
}

/* Adds the pending rows to the columns in line order (with a table: hashed side by side,
 * and copies dropped); -1 with an exception set on failure. */
static int decoder_flush(Decoder *d) {
    int k = d->pending;
    d->pending = 0;
    uint8_t digests[GROUP][16];
    if (d->table != NULL && k > 0) {
        const uint8_t *msg[GROUP];
        size_t len[GROUP];
        for (int i = 0; i < k; i++) {
            if (row_serialize(&d->rows[i], &d->serialized[i]) != J_OK)
                return no_memory();
            msg[i] = d->serialized[i].data;
            len[i] = d->serialized[i].len;
        }
        blake2b16_many(msg, len, (size_t)k, digests[0]);
    }
    for (int i = 0; i < k; i++) {
        if (d->table != NULL) {
            if (decoder_is_copy(d, &d->rows[i], digests[i]))
                continue;
            char hex[32];
            hex_digest(digests[i], hex);
            if (buf_put(&d->hashes, hex, sizeof hex) != J_OK)
                return no_memory();
        }
        if (columns_add(&d->cols, &d->rows[i], d->index[i]) != J_OK)
            return no_memory();
    }
    return 0;
}

/* Decodes line number `index` of the call; -1 with an exception set on failure. A call's
 * lines end with decoder_flush. */
static int decoder_line(Decoder *d, const uint8_t *line, Py_ssize_t n, Py_ssize_t index) {
    int what = LINE_DECLINED;
    if (n <= d->max_line) {
        row_reset(&d->rows[d->pending]);
        what = capture_line(line, (size_t)n, &d->rows[d->pending]);
    }
    if (what == LINE_ROW) {
        d->index[d->pending++] = (int64_t)index;
        return d->pending == GROUP ? decoder_flush(d) : 0;
    }
    if (what == J_NOMEM)
        return no_memory();
    if (what == LINE_SKIP) {
        d->skips++;
    } else if (what == LINE_DECLINED) {
        PyObject *idx = PyLong_FromSsize_t(index);
        if (idx == NULL || PyList_Append(d->declined, idx) < 0) {
            Py_XDECREF(idx);
            return -1;
        }
        Py_DECREF(idx);
    }
    return 0;
}

PyDoc_STRVAR(decode_chunk_doc,
             "decode_chunk(lines: list[bytes], max_line: int) -> dict\n\n"
             "Capture lines -> Arrow buffers of their rows; tabular lines are counted in 'skips' and every\n"
             "line not decided exactly is listed (by index) in 'declined'.");

static PyObject *decode_chunk(PyObject *self, PyObject *args) {
    PyObject *lines, *result = NULL;
    Py_ssize_t max_line;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &lines, &max_line))
        return NULL;
    Decoder d;
    if (decoder_init(&d, max_line) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(lines); i++) {
        PyObject *line = PyList_GET_ITEM(lines, i);
        if (!PyBytes_Check(line)) {
            PyErr_SetString(PyExc_TypeError, "lines must be bytes");
            goto done;
        }
        if (decoder_line(&d, (const uint8_t *)PyBytes_AS_STRING(line), PyBytes_GET_SIZE(line), i) < 0)
            goto done;
    }
    if (decoder_flush(&d) < 0)
        goto done;
    result = columns_dict(&d.cols, d.declined, d.skips);
done:
    decoder_free(&d);
    return result;
}

PyDoc_STRVAR(decode_block_doc,
             "decode_block(block, start: int, max_lines: int, max_line: int) -> dict\n\n"
             "decode_chunk over the lines of a buffer of whole lines, from byte `start` on, at most\n"
             "`max_lines` of them: lines end at '\\n' (not part of the line); the buffer's last line\n"
             "may lack it; a final '\\n' makes no empty line. Also gives 'lines' (how many were read),\n"
             "'end' (the byte after the last one's newline) and 'starts' (int64, lines + 1 offsets:\n"
             "line i is block[starts[i]:starts[i + 1]] less its newline).\n\n"
             "decode_block(block, start, max_lines, max_line, table, slots, room, hour_known) also drops\n"
             "the rows whose content hash is in `table` (a digest table as digests_add_new takes it), and\n"
             "adds at most `room` new ones: only rows whose time cannot send them to quarantine (canonical,\n"
             "or `hour_known`); it also gives 'hashes' (32 hex per row kept), 'duplicates' (rows dropped),\n"
             "'inserted' and 'unchecked' (rows kept that did not go into the table).");

static int table_arg(PyObject *obj, Py_ssize_t slots, Py_buffer *view);

static PyObject *decode_block(PyObject *self, PyObject *args) {
    Py_buffer block, table;
    Py_ssize_t start, max_lines, max_line, slots = 0, room = 0;
    PyObject *o_table = Py_None;
    int hour_known = 0, have_table = 0;
    if (!PyArg_ParseTuple(args, "y*nnn|Onnp", &block, &start, &max_lines, &max_line, &o_table, &slots, &room,
                          &hour_known))
        return NULL;
    PyObject *result = NULL;
    Buf starts = {0};
    Decoder d;
    if (decoder_init(&d, max_line) < 0)
        goto done;
    if (start < 0 || start > block.len || max_lines < 0) {
        PyErr_SetString(PyExc_ValueError, "decode_block: start outside the block or max_lines < 0");
        goto done;
    }
    if (o_table != Py_None) {
        if (table_arg(o_table, slots, &table) < 0)
            goto done;
        have_table = 1;
        if (room < 0 || room > slots / 2) {
            PyErr_SetString(PyExc_ValueError, "decode_block: room must keep the table at most half full");
            goto done;
        }
        d.table = table.buf;
        d.slots = (size_t)slots;
        d.room = (size_t)room;
        d.hour_known = hour_known;
    }
    const uint8_t *base = (const uint8_t *)block.buf, *end = base + block.len, *p = base + start;
    Py_ssize_t i = 0;
    for (; i < max_lines && p < end; i++) {
        const uint8_t *nl = memchr(p, '\n', (size_t)(end - p));
        const uint8_t *line_end = nl ? nl : end;
        int64_t at = (int64_t)(p - base);
        if (buf_put(&starts, &at, sizeof at) != J_OK) {
            PyErr_NoMemory();
            goto done;
        }
        if (decoder_line(&d, p, line_end - p, i) < 0)
            goto done;
        p = nl ? nl + 1 : end;
    }
    int64_t at = (int64_t)(p - base);
    if (buf_put(&starts, &at, sizeof at) != J_OK) {
        PyErr_NoMemory();
        goto done;
    }
    if (decoder_flush(&d) < 0)
        goto done;
    result = columns_dict(&d.cols, d.declined, d.skips);
    if (result != NULL) {
        PyObject *lines = PyLong_FromSsize_t(i), *end_at = PyLong_FromSsize_t(p - base), *st = take_buf(&starts);
        if (lines == NULL || end_at == NULL || st == NULL || PyDict_SetItemString(result, "lines", lines) < 0 ||
            PyDict_SetItemString(result, "end", end_at) < 0 || PyDict_SetItemString(result, "starts", st) < 0)
            Py_CLEAR(result);
        Py_XDECREF(lines);
        Py_XDECREF(end_at);
        Py_XDECREF(st);
    }
    if (result != NULL && have_table) {
        PyObject *hashes = take_buf(&d.hashes), *dups = PyLong_FromLongLong(d.duplicates),
                 *ins = PyLong_FromSize_t(d.inserted), *unchecked = PyLong_FromSize_t(d.unchecked);
        if (hashes == NULL || dups == NULL || ins == NULL || unchecked == NULL ||
            PyDict_SetItemString(result, "hashes", hashes) < 0 || PyDict_SetItemString(result, "duplicates", dups) < 0 ||
            PyDict_SetItemString(result, "inserted", ins) < 0 || PyDict_SetItemString(result, "unchecked", unchecked) < 0)
            Py_CLEAR(result);
        Py_XDECREF(hashes);
        Py_XDECREF(dups);
        Py_XDECREF(ins);
        Py_XDECREF(unchecked);
    }
done:
    if (have_table)
        PyBuffer_Release(&table);
    decoder_free(&d);
    buf_free(&starts);
    PyBuffer_Release(&block);
    return result;
}

/* A read-only contiguous buffer argument. */
typedef struct {
    Py_buffer view;
    int held;
} Arg;

static int arg_get(PyObject *obj, Arg *a) {
    if (PyObject_GetBuffer(obj, &a->view, PyBUF_SIMPLE) < 0)
        return -1;
    a->held = 1;
    return 0;
}

static void arg_release(Arg *a) {
    if (a->held)
        PyBuffer_Release(&a->view);
    a->held = 0;
}

/* One Arrow utf8 array given by its offsets and data buffers, checked before use. */
typedef struct {
    const int32_t *offsets;
    const uint8_t *data;
    Py_ssize_t offset, length;
} Utf8;

static int utf8_check(Utf8 *u, const Arg *offsets, const Arg *data, Py_ssize_t offset, Py_ssize_t length) {
    u->offsets = (const int32_t *)offsets->view.buf;
    u->data = (const uint8_t *)data->view.buf;
    u->offset = offset;
    u->length = length;
    if (offset < 0 || length < 0 || (offsets->view.len / 4) < offset + length + 1) {
        PyErr_SetString(PyExc_ValueError, "string offsets buffer too short");
        return -1;
    }
    for (Py_ssize_t i = offset; i < offset + length; i++)
        if (u->offsets[i] < 0 || u->offsets[i] > u->offsets[i + 1] || u->offsets[i + 1] > data->view.len) {
            PyErr_SetString(PyExc_ValueError, "string offsets out of bounds");
            return -1;
        }
    return 0;
}

/* The buffers of a nullable utf8 array argument: (array offset, length, offsets, data,
 * validity or None), checked; the caller releases the three Args. */
typedef struct {
    Arg offsets, data, validity;
    Utf8 u;
    const uint8_t *valid; /* the validity bitmap, or NULL: all valid */
} Utf8Arg;

static int utf8_arg(PyObject *args, Utf8Arg *a) {
    PyObject *o_offsets, *o_data, *o_validity;
    Py_ssize_t offset, length;
    memset(a, 0, sizeof *a);
    if (!PyArg_ParseTuple(args, "nnOOO", &offset, &length, &o_offsets, &o_data, &o_validity))
        return -1;
    if (arg_get(o_offsets, &a->offsets) < 0 || arg_get(o_data, &a->data) < 0 ||
        (o_validity != Py_None && arg_get(o_validity, &a->validity) < 0))
        return -1;
    if (utf8_check(&a->u, &a->offsets, &a->data, offset, length) < 0)
        return -1;
    if (a->validity.held && a->validity.view.len * 8 < offset + length) {
        PyErr_SetString(PyExc_ValueError, "validity bitmap too short");
        return -1;
    }
    a->valid = a->validity.held ? (const uint8_t *)a->validity.view.buf : NULL;
    return 0;
}

static void utf8_arg_release(Utf8Arg *a) {
    arg_release(&a->offsets);
    arg_release(&a->data);
    arg_release(&a->validity);
}

/* Code points of valid UTF-8: the bytes that do not continue a character (10xxxxxx). */
static size_t count_code_points(const uint8_t *p, size_t n) {
    size_t continuation = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        /* 1 in each byte whose high bit is set and the next one clear, summed by one multiply
         * (__builtin_popcountll is a libgcc call without -mpopcnt) */
        uint64_t ones = (v & ~(v << 1) & 0x8080808080808080ULL) >> 7;
        continuation += (size_t)((ones * 0x0101010101010101ULL) >> 56);
    }
    for (; i < n; i++)
        continuation += (p[i] & 0xC0) == 0x80;
    return n - continuation;
}

/* Digits of n in decimal. */
static int decimal_len(uint64_t n) {
    int k = 1;
    while (n >= 10) {
        n /= 10;
        k++;
    }
    return k;
}

/* n in decimal into out (decimal_len(n) bytes); returns its length. */
static int decimal(uint64_t n, char *out) {
    int len = decimal_len(n);
    for (int i = len - 1; i >= 0; i--, n /= 10)
        out[i] = (char)('0' + n % 10);
    return len;
}

/* ":<n>:" in decimal; returns its length. */
static int length_field(char *out, size_t n) {
    out[0] = ':';
    int len = 1 + decimal(n, out + 1);
    out[len++] = ':';
    return len;
}

/* Appends what content_hash hashes of one turn, "from:len:value", where the value is the
 * concatenation of `count` pieces (len counts code points: lead bytes, which add up over pieces). */
static int put_turn(Buf *out, const uint8_t *from, size_t from_len, const Span *pieces, size_t count) {
    size_t chars = 0;
    for (size_t k = 0; k < count; k++)
        chars += count_code_points(pieces[k].ptr, pieces[k].len);
    char len_text[32];
    int n = length_field(len_text, chars);
    if (buf_put(out, from, from_len) != J_OK || buf_put(out, len_text, (size_t)n) != J_OK)
        return J_NOMEM;
    for (size_t k = 0; k < count; k++)
        if (buf_put(out, pieces[k].ptr, pieces[k].len) != J_OK)
            return J_NOMEM;
    return J_OK;
}

/* What content_hash hashes of turns [first, end) of two utf8 columns. */
static int columns_serialize(const Utf8 *from, const Utf8 *value, int32_t first, int32_t end, Buf *out) {
    out->len = 0;
    for (int32_t t = first; t < end; t++) {
        const int32_t *fo = from->offsets + from->offset + t, *vo = value->offsets + value->offset + t;
        Span v = {value->data + vo[0], (size_t)(vo[1] - vo[0])};
        if (put_turn(out, from->data + fo[0], (size_t)(fo[1] - fo[0]), &v, 1) != J_OK)
            return J_NOMEM;
    }
    return J_OK;
}

static uint64_t magnitude(int32_t v) { return v < 0 ? (uint64_t)(-(int64_t)v) : (uint64_t)v; }

/* The turn "name:len:[a, b, ...]" of a token id list (Python's str of the list; "" when absent). */
static int put_ids_turn(Buf *out, const char *name, const Buf *ids, int has) {
    const int32_t *v = (const int32_t *)ids->data;
    size_t n = has ? ids->len / 4 : 0, chars = has ? 2 : 0;
    for (size_t i = 0; i < n; i++)
        chars += (size_t)(decimal_len(magnitude(v[i])) + (v[i] < 0)) + (i ? 2 : 0);
    char len_text[32];
    int lf = length_field(len_text, chars);
    if (buf_put(out, name, strlen(name)) != J_OK || buf_put(out, len_text, (size_t)lf) != J_OK)
        return J_NOMEM;
    if (!has)
        return J_OK;
    if (buf_reserve(out, chars) != J_OK)
        return J_NOMEM;
    char *p = (char *)out->data + out->len;
    *p++ = '[';
    for (size_t i = 0; i < n; i++) {
        if (i) {
            *p++ = ',';
            *p++ = ' ';
        }
        if (v[i] < 0)
            *p++ = '-';
        p += decimal(magnitude(v[i]), p);
    }
    *p++ = ']';
    out->len += chars;
    return J_OK;
}

static int put_text_turn(Buf *out, const char *name, const uint8_t *p, size_t n, int has) {
    Span v = {has && p != NULL ? p : (const uint8_t *)"", has ? n : 0};
    return put_turn(out, (const uint8_t *)name, strlen(name), &v, 1);
}

/* What content_hash hashes of a decoded row. A row kept exactly is hashed as
 * capture.ingest._exact_hashes hashes it: its turns, then a turn "\x1fexchange" with no text
 * and a turn of each of capture.ingest.EXCHANGE_COLUMNS in that order (its text, or "" where
 * the column is null), so that the decoder's hash of such a row is the one ingest stores. */
static int row_serialize(const Row *row, Buf *out) {
    const Turn *turns = (const Turn *)row->turns.data;
    const Span *pieces = (const Span *)row->pieces.data;
    size_t n_turns = row->turns.len / sizeof(Turn);
    out->len = 0;
    for (size_t t = 0; t < n_turns; t++) {
        Span from = from_name(turns[t].from);
        if (put_turn(out, from.ptr, from.len, pieces + turns[t].first, turns[t].count) != J_OK)
            return J_NOMEM;
    }
    if (!row_exact(row))
        return J_OK;
    const Exchange *ex = &row->ex;
    const Span *fin = &row->finish_reason;
    if (put_text_turn(out, "\x1f" "exchange", NULL, 0, 0) != J_OK ||
        put_text_turn(out, "messages", ex->messages.data, ex->messages.len, ex->has_messages) != J_OK ||
        put_text_turn(out, "tools", ex->tools.data, ex->tools.len, ex->has_tools) != J_OK ||
        put_text_turn(out, "tool_choice", ex->tool_choice.data, ex->tool_choice.len, ex->has_tool_choice) != J_OK ||
        put_text_turn(out, "chat_template_kwargs", ex->kwargs.data, ex->kwargs.len, ex->has_kwargs) != J_OK ||
        put_text_turn(out, "finish_reason", fin->ptr, fin->len, fin->ptr != NULL) != J_OK ||
        put_ids_turn(out, "prompt_token_ids", &ex->prompt_ids, ex->has_prompt_ids) != J_OK ||
        put_ids_turn(out, "output_token_ids", &ex->output_ids, ex->has_output_ids) != J_OK)
        return J_NOMEM;
    return J_OK;
}

static void hex_digest(const uint8_t digest[16], char *out) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out[2 * i] = digits[digest[i] >> 4];
        out[2 * i + 1] = digits[digest[i] & 15];
    }
}

/* The hex digests of turns [first[r], end[r]) for r < n (content_hash of each range) into hex
 * (32 * n bytes); the ranges are checked by the caller. 0, or -1 with MemoryError set. */
static int hash_ranges(const Utf8 *from, const Utf8 *value, const int32_t *first, const int32_t *end, Py_ssize_t n,
                       char *hex) {
    Buf serialized[GROUP] = {{0}};
    int rc = 0;
    /* GROUP ranges at a time, hashed side by side. */
    for (Py_ssize_t r0 = 0; r0 < n && rc == 0; r0 += GROUP) {
        int k = n - r0 < GROUP ? (int)(n - r0) : GROUP;
        const uint8_t *msg[GROUP];
        size_t len[GROUP];
        uint8_t digests[GROUP][16];
        for (int i = 0; i < k; i++) {
            if (columns_serialize(from, value, first[r0 + i], end[r0 + i], &serialized[i]) != J_OK) {
                PyErr_NoMemory();
                rc = -1;
                break;
            }
            msg[i] = serialized[i].data;
            len[i] = serialized[i].len;
        }
        if (rc == 0) {
            blake2b16_many(msg, len, (size_t)k, digests[0]);
            for (int i = 0; i < k; i++)
                hex_digest(digests[i], hex + 32 * (r0 + i));
        }
    }
    for (int i = 0; i < GROUP; i++)
        buf_free(&serialized[i]);
    return rc;
}

/* The from/value utf8 arguments shared by content_hashes and range_hashes, checked. */
static int turn_columns(Utf8 *from, Utf8 *value, Arg *fo, Arg *fd, Arg *vo, Arg *vd, PyObject *o_fo, PyObject *o_fd,
                        PyObject *o_vo, PyObject *o_vd, Py_ssize_t f_off, Py_ssize_t f_len, Py_ssize_t v_off,
                        Py_ssize_t v_len) {
    if (arg_get(o_fo, fo) < 0 || arg_get(o_fd, fd) < 0 || arg_get(o_vo, vo) < 0 || arg_get(o_vd, vd) < 0)
        return -1;
    if (utf8_check(from, fo, fd, f_off, f_len) < 0 || utf8_check(value, vo, vd, v_off, v_len) < 0)
        return -1;
    if (f_len != v_len) {
        PyErr_SetString(PyExc_ValueError, "from/value lengths differ");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(content_hashes_doc,
             "content_hashes(row_offsets, from_offset, from_length, from_offsets, from_data,\n"
             "               value_offset, value_length, value_offsets, value_data) -> bytes\n\n"
             "32 hex characters per row: capture.ingest.content_hash of each row's turns, given as Arrow\n"
             "int32 row offsets into two utf8 arrays (array offset, length, offsets buffer, data buffer).");

static PyObject *content_hashes(PyObject *self, PyObject *args) {
    PyObject *o_rows, *o_fo, *o_fd, *o_vo, *o_vd;
    Py_ssize_t f_off, f_len, v_off, v_len;
    if (!PyArg_ParseTuple(args, "OnnOOnnOO", &o_rows, &f_off, &f_len, &o_fo, &o_fd, &v_off, &v_len, &o_vo, &o_vd))
        return NULL;
    Arg rows = {0}, fo = {0}, fd = {0}, vo = {0}, vd = {0};
    PyObject *out = NULL;
    Utf8 from, value;
    if (arg_get(o_rows, &rows) < 0 ||
        turn_columns(&from, &value, &fo, &fd, &vo, &vd, o_fo, o_fd, o_vo, o_vd, f_off, f_len, v_off, v_len) < 0)
        goto done;
    if (rows.view.len < 4) {
        PyErr_SetString(PyExc_ValueError, "no row offsets");
        goto done;
    }
    const int32_t *row_offsets = (const int32_t *)rows.view.buf;
    Py_ssize_t n = rows.view.len / 4 - 1;
    for (Py_ssize_t r = 0; r < n; r++)
        if (row_offsets[r] < 0 || row_offsets[r] > row_offsets[r + 1] || row_offsets[r + 1] > f_len) {
            PyErr_SetString(PyExc_ValueError, "row offsets out of bounds");
            goto done;
        }
    out = PyBytes_FromStringAndSize(NULL, 32 * n);
    if (out == NULL)
        goto done;
    if (hash_ranges(&from, &value, row_offsets, row_offsets + 1, n, PyBytes_AS_STRING(out)) < 0)
        Py_CLEAR(out);
done:
    arg_release(&rows);
    arg_release(&fo);
    arg_release(&fd);
    arg_release(&vo);
    arg_release(&vd);
    return out;
}

PyDoc_STRVAR(range_hashes_doc,
             "range_hashes(starts, ends, from_offset, from_length, from_offsets, from_data,\n"
             "             value_offset, value_length, value_offsets, value_data) -> bytes\n\n"
             "32 hex characters per range: capture.ingest.content_hash of turns [starts[i], ends[i]) of\n"
             "two utf8 arrays (as content_hashes takes them); starts and ends are int32 buffers of one\n"
             "length. Ranges may overlap: capture.stitch hashes a row's prefixes with it.");

static PyObject *range_hashes(PyObject *self, PyObject *args) {
    PyObject *o_starts, *o_ends, *o_fo, *o_fd, *o_vo, *o_vd;
    Py_ssize_t f_off, f_len, v_off, v_len;
    if (!PyArg_ParseTuple(args, "OOnnOOnnOO", &o_starts, &o_ends, &f_off, &f_len, &o_fo, &o_fd, &v_off, &v_len, &o_vo,
                          &o_vd))
        return NULL;
    Arg starts = {0}, ends = {0}, fo = {0}, fd = {0}, vo = {0}, vd = {0};
    PyObject *out = NULL;
    Utf8 from, value;
    if (arg_get(o_starts, &starts) < 0 || arg_get(o_ends, &ends) < 0 ||
        turn_columns(&from, &value, &fo, &fd, &vo, &vd, o_fo, o_fd, o_vo, o_vd, f_off, f_len, v_off, v_len) < 0)
        goto done;
    if (starts.view.len != ends.view.len || starts.view.len % 4) {
        PyErr_SetString(PyExc_ValueError, "starts and ends must be int32 buffers of one length");
        goto done;
    }
    const int32_t *first = (const int32_t *)starts.view.buf, *end = (const int32_t *)ends.view.buf;
    Py_ssize_t n = starts.view.len / 4;
    for (Py_ssize_t r = 0; r < n; r++)
        if (first[r] < 0 || first[r] > end[r] || end[r] > f_len) {
            PyErr_SetString(PyExc_ValueError, "ranges out of bounds");
            goto done;
        }
    out = PyBytes_FromStringAndSize(NULL, 32 * n);
    if (out == NULL)
        goto done;
    if (hash_ranges(&from, &value, first, end, n, PyBytes_AS_STRING(out)) < 0)
        Py_CLEAR(out);
done:
    arg_release(&starts);
    arg_release(&ends);
    arg_release(&fo);
    arg_release(&fd);
    arg_release(&vo);
    arg_release(&vd);
    return out;
}

PyDoc_STRVAR(parse_times_doc,
             "parse_times(offset, length, offsets, data, validity) -> (values: bytes, validity: bytes, pending: int)\n\n"
             "A utf8 array (array offset, length, offsets buffer, data buffer, validity buffer or None) of\n"
             "inferenceTime strings -> int64 microseconds and a validity bitmap: valid where the string is\n"
             "canonical (capture.batchpath.parse_times); 'pending' counts the others, left to Python.");

static PyObject *parse_times(PyObject *self, PyObject *args) {
    Utf8Arg a;
    PyObject *values = NULL, *bits = NULL, *result = NULL;
    if (utf8_arg(args, &a) < 0)
        goto done;
    if (!RULES.configured) {
        not_configured();
        goto done;
    }
    Py_ssize_t offset = a.u.offset, length = a.u.length;
    values = PyBytes_FromStringAndSize(NULL, 8 * length);
    bits = PyBytes_FromStringAndSize(NULL, (length + 7) / 8);
    if (values == NULL || bits == NULL)
        goto done;
    int64_t *out = (int64_t *)PyBytes_AS_STRING(values);
    uint8_t *valid = (uint8_t *)PyBytes_AS_STRING(bits);
    memset(valid, 0, (size_t)(length + 7) / 8);
    Py_ssize_t pending = 0;
    for (Py_ssize_t i = 0; i < length; i++) {
        Py_ssize_t j = offset + i;
        int64_t us = 0;
        int ok = (a.valid == NULL || (a.valid[j >> 3] >> (j & 7)) & 1) &&
                 canonical_time(a.u.data + a.u.offsets[j], (size_t)(a.u.offsets[j + 1] - a.u.offsets[j]), &us);
        out[i] = us;
        if (ok)
            valid[i >> 3] |= (uint8_t)(1u << (i & 7));
        pending += !ok;
    }
    result = Py_BuildValue("(OOn)", values, bits, pending);
done:
    Py_XDECREF(values);
    Py_XDECREF(bits);
    utf8_arg_release(&a);
    return result;
}

PyDoc_STRVAR(redact_gate_doc,
             "redact_gate(offset, length, offsets, data, validity) -> bytes\n\n"
             "The indices (int64, from the array's start) of the strings of a utf8 array (array offset,\n"
             "length, offsets buffer, data buffer, validity buffer or None) that capture.redact.GATE may\n"
             "match: a superset of what RE2 flags (see gate.c); null strings are never flagged.");

PyDoc_STRVAR(redact_gate_json_doc,
             "redact_gate_json(offset, length, offsets, data, validity) -> bytes\n\n"
             "redact_gate over JSON texts read with their escapes \\\\, \\\", \\n, \\t, \\r undone (every JSON\n"
             "string then stands whole in the text): the indices (int64) of the texts the gate flags there,\n"
             "and of those holding a backslash before b, f, u or / after the undoing (the control\n"
             "characters and escapes it leaves); null texts are never flagged.");

/* s[0, n) with the escapes \\ \" \n \t \r undone into out (n bytes of room): capture.redact's
 * sequential replacements, which pair backslashes left to right as JSON does. */
static size_t json_unescaped(const uint8_t *s, size_t n, uint8_t *out) {
    size_t i = 0, k = 0;
    while (i < n) {
        const uint8_t *bs = memchr(s + i, '\\', n - i);
        size_t run = bs == NULL ? n - i : (size_t)(bs - (s + i));
        memcpy(out + k, s + i, run);
        k += run;
        i += run;
        if (i >= n)
            break;
        uint8_t c = i + 1 < n ? s[i + 1] : 0;
        uint8_t to = c == '\\' ? '\\' : c == '"' ? '"' : c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : 0;
        if (to) {
            out[k++] = to;
            i += 2;
        } else {
            out[k++] = '\\';
            i += 1;
        }
    }
    return k;
}

static int odd_escape(const uint8_t *v, size_t n) {
    for (const uint8_t *p = v, *end = v + n; (p = memchr(p, '\\', (size_t)(end - p))) != NULL && p + 1 < end; p++)
        if (p[1] == 'b' || p[1] == 'f' || p[1] == 'u' || p[1] == '/')
            return 1;
    return 0;
}

/* redact_gate (json 0) or redact_gate_json (json 1) over a utf8 array argument. */
static PyObject *gate_over(PyObject *args, int json) {
    Utf8Arg a;
    PyObject *result = NULL;
    Buf hits = {0}, view = {0};
    if (utf8_arg(args, &a) < 0)
        goto done;
    const uint8_t *limit = a.u.data + a.data.view.len;
    int failed = 0;
    for (Py_ssize_t i = 0; i < a.u.length && !failed; i++) {
        Py_ssize_t j = a.u.offset + i;
        if (a.valid != NULL && !((a.valid[j >> 3] >> (j & 7)) & 1))
            continue;
        const uint8_t *s = a.u.data + a.u.offsets[j];
        size_t n = (size_t)(a.u.offsets[j + 1] - a.u.offsets[j]);
        int hit;
        if (json) {
            view.len = 0;
            if (buf_reserve(&view, n + 1) != J_OK) {
                failed = 1;
                break;
            }
            size_t m = json_unescaped(s, n, view.data);
            hit = odd_escape(view.data, m) || gate_match(view.data, m, view.data + m);
        } else {
            hit = gate_match(s, n, limit);
        }
        if (hit) {
            int64_t at = (int64_t)i;
            failed = buf_put(&hits, &at, sizeof at) != J_OK;
        }
    }
    if (failed)
        PyErr_NoMemory();
    else
        result = bytes_of(&hits);
done:
    buf_free(&hits);
    buf_free(&view);
    utf8_arg_release(&a);
    return result;
}

static PyObject *redact_gate(PyObject *self, PyObject *args) { return gate_over(args, 0); }

static PyObject *redact_gate_json(PyObject *self, PyObject *args) { return gate_over(args, 1); }

/* A writable digest table argument (digests.h) of `slots` slots, checked. */
static int table_arg(PyObject *obj, Py_ssize_t slots, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0)
        return -1;
    if (slots < 1 || (slots & (slots - 1)) || view->len != 16 * (slots + 1)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "digest table: slots must be a power of two and the buffer 16 * (slots + 1) bytes");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(digests_add_new_doc,
             "digests_add_new(table, slots, offset, length, offsets, data, validity) -> bytes\n\n"
             "Adds the digests given as 32 lowercase hex characters per string (an Arrow utf8 array's\n"
             "buffers) to the table, a writable buffer of 16 * (slots + 1) bytes (see digests.h); one\n"
             "byte per string back, 1 where it was new. The caller keeps the table at most half full.\n"
             "Any null or other text raises ValueError before anything is added.");

/* The arguments of digests_add_new and digests_contains: (table, slots, then a utf8 array as
 * utf8_arg takes it), checked. On success the caller releases `a` and `table`; on failure
 * nothing is held. */
static int digest_args(PyObject *args, const char *name, Utf8Arg *a, Py_buffer *table, Py_ssize_t *slots) {
    memset(a, 0, sizeof *a);
    if (PyTuple_GET_SIZE(args) != 7) {
        PyErr_Format(PyExc_TypeError, "%s takes 7 arguments", name);
        return -1;
    }
    *slots = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 1));
    if (*slots == -1 && PyErr_Occurred())
        return -1;
    PyObject *rest = PyTuple_GetSlice(args, 2, 7);
    if (rest == NULL)
        return -1;
    int rc = utf8_arg(rest, a);
    Py_DECREF(rest);
    if (rc == 0 && table_arg(PyTuple_GET_ITEM(args, 0), *slots, table) == 0)
        return 0;
    utf8_arg_release(a);
    return -1;
}

/* String i of the array as a digest; 0 with ValueError set if it is null or not 32 lowercase hex characters. */
static int digest_at(const Utf8Arg *a, Py_ssize_t i, uint8_t out[16]) {
    Py_ssize_t j = a->u.offset + i;
    const int32_t *o = a->u.offsets + j;
    if ((a->valid != NULL && !((a->valid[j >> 3] >> (j & 7)) & 1)) ||
        !digest_from_hex(a->u.data + o[0], (size_t)(o[1] - o[0]), out)) {
        PyErr_Format(PyExc_ValueError, "content hash %zd is not 32 lowercase hex characters", i);
        return 0;
    }
    return 1;
}

static PyObject *digests_add_new(PyObject *self, PyObject *args) {
    Utf8Arg a;
    Py_buffer table;
    Py_ssize_t slots;
    if (digest_args(args, "digests_add_new", &a, &table, &slots) < 0)
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = a.u.length;
    uint8_t *digests = PyMem_Malloc(16 * (size_t)(n ? n : 1));
    if (digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!digest_at(&a, i, digests + 16 * i))
            goto done;
    if ((out = PyBytes_FromStringAndSize(NULL, n)) == NULL)
        goto done;
    uint8_t *mask = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        int added = digests_add(table.buf, (size_t)slots, digests + 16 * i);
        if (added < 0) {
            Py_CLEAR(out);
            PyErr_SetString(PyExc_ValueError, "digest table full");
            goto done;
        }
        mask[i] = (uint8_t)added;
    }
done:
    PyMem_Free(digests);
    PyBuffer_Release(&table);
    utf8_arg_release(&a);
    return out;
}

PyDoc_STRVAR(digests_contains_doc,
             "digests_contains(table, slots, offset, length, offsets, data, validity) -> bytes\n\n"
             "One byte per string of the utf8 array (as digests_add_new takes it), 1 where its digest is in\n"
             "the table; nothing is added. Any null or other text raises ValueError.");

static PyObject *digests_contains_py(PyObject *self, PyObject *args) {
    Utf8Arg a;
    Py_buffer table;
    Py_ssize_t slots;
    if (digest_args(args, "digests_contains", &a, &table, &slots) < 0)
        return NULL;
    Py_ssize_t n = a.u.length;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out != NULL) {
        uint8_t *mask = (uint8_t *)PyBytes_AS_STRING(out);
        uint8_t digest[16];
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!digest_at(&a, i, digest)) {
                Py_CLEAR(out);
                break;
            }
            mask[i] = (uint8_t)digests_contains(table.buf, (size_t)slots, digest);
        }
    }
    PyBuffer_Release(&table);
    utf8_arg_release(&a);
    return out;
}

PyDoc_STRVAR(digests_rehash_doc,
             "digests_rehash(old_table, old_slots, new_table, new_slots): every digest of the old table\n"
             "(at most half full) into the new, empty one.");

static PyObject *py_digests_rehash(PyObject *self, PyObject *args) {
    PyObject *o_old, *o_new;
    Py_ssize_t old_slots, new_slots;
    if (!PyArg_ParseTuple(args, "OnOn", &o_old, &old_slots, &o_new, &new_slots))
        return NULL;
    Py_buffer old, new;
    if (table_arg(o_old, old_slots, &old) < 0)
        return NULL;
    if (table_arg(o_new, new_slots, &new) < 0) {
        PyBuffer_Release(&old);
        return NULL;
    }
    if (new_slots < old_slots) {
        PyBuffer_Release(&old);
        PyBuffer_Release(&new);
        PyErr_SetString(PyExc_ValueError, "the new table must have at least as many slots");
        return NULL;
    }
    digests_rehash(old.buf, (size_t)old_slots, new.buf, (size_t)new_slots);
    PyBuffer_Release(&old);
    PyBuffer_Release(&new);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(blake2b16_many_doc, "blake2b16_many(messages: list[bytes]) -> bytes: their 16-byte digests, side by side\n"
                                 "(the vector path, for tests against hashlib).");

static PyObject *py_blake2b16_many(PyObject *self, PyObject *arg) {
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "a list of bytes");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    const uint8_t **msg = PyMem_Malloc(sizeof *msg * (size_t)(n + 1));
    size_t *len = PyMem_Malloc(sizeof *len * (size_t)(n + 1));
    PyObject *out = NULL;
    if (msg == NULL || len == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(arg, i);
        if (!PyBytes_Check(b)) {
            PyErr_SetString(PyExc_TypeError, "a list of bytes");
            goto done;
        }
        msg[i] = (const uint8_t *)PyBytes_AS_STRING(b);
        len[i] = (size_t)PyBytes_GET_SIZE(b);
    }
    if ((out = PyBytes_FromStringAndSize(NULL, 16 * n)) != NULL)
        blake2b16_many(msg, len, (size_t)n, (uint8_t *)PyBytes_AS_STRING(out));
done:
    PyMem_Free(msg);
    PyMem_Free(len);
    return out;
}

/* ---- configure: the rules of capture/rules.py ------------------------------------------ */

enum { ANY_CASE, LOWER, UPPER };

/* An ASCII str (of the given case, shorter than RULE_TEXT) into *out. */
static int rule_text(PyObject *obj, const char *what, int want_case, RuleText *out) {
    Py_ssize_t n;
    const char *s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8AndSize(obj, &n) : NULL;
    if (s == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "configure: %s must be a str", what);
        return -1;
    }
    if (n >= RULE_TEXT) {
        PyErr_Format(PyExc_ValueError, "configure: %s is longer than %d bytes", what, RULE_TEXT - 1);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t c = (uint8_t)s[i];
        /* The decoder compares case-folded ASCII (non-ASCII input declines), so the rule must be
         * ASCII in the case it compares against. */
        if (c >= 0x80 || (want_case == LOWER && c >= 'A' && c <= 'Z') || (want_case == UPPER && c >= 'a' && c <= 'z')) {
            PyErr_Format(PyExc_ValueError, "configure: %s must be %sASCII", what,
                         want_case == LOWER ? "lowercase " : want_case == UPPER ? "uppercase " : "");
            return -1;
        }
    }
    memcpy(out->s, s, (size_t)n);
    out->len = (size_t)n;
    return 0;
}

static PyObject *rule_item(PyObject *rules, const char *key) {
    PyObject *v = PyDict_GetItemString(rules, key); /* borrowed */
    if (v == NULL)
        PyErr_Format(PyExc_KeyError, "configure: the rules have no '%s'", key);
    return v;
}

static int rule_str(PyObject *rules, const char *key, int want_case, RuleText *out) {
    PyObject *v = rule_item(rules, key);
    return v == NULL ? -1 : rule_text(v, key, want_case, out);
}

/* A sequence of exactly n strs. */
static int rule_names(PyObject *rules, const char *key, int want_case, RuleText *out, int n) {
    PyObject *v = rule_item(rules, key), *seq;
    if (v == NULL || (seq = PySequence_Fast(v, "configure: a sequence of names")) == NULL)
        return -1;
    int rc = 0;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "configure: %s must name %d", key, n);
        rc = -1;
    }
    for (int i = 0; rc == 0 && i < n; i++)
        rc = rule_text(PySequence_Fast_GET_ITEM(seq, i), key, want_case, &out[i]);
    Py_DECREF(seq);
    return rc;
}

/* (lo, hi), floats. */
static int rule_range(PyObject *rules, const char *key, double *lo, double *hi) {
    PyObject *v = rule_item(rules, key);
    if (v == NULL)
        return -1;
    if (!PyArg_ParseTuple(v, "dd", lo, hi)) {
        PyErr_Format(PyExc_TypeError, "configure: %s must be (lo, hi)", key);
        return -1;
    }
    return 0;
}

/* The time layout and where its fields are: {"layout": str, "fields": {name: (at, width)}}. */
static int rule_time(PyObject *rules, Rules *r) {
    static const char *const names[N_TIME_FIELDS] = {"year", "month", "day", "hour", "minute", "second"};
    PyObject *fields = rule_item(rules, "time_fields");
    if (rule_str(rules, "time_layout", ANY_CASE, &r->time_layout) < 0 || fields == NULL)
        return -1;
    if (!PyDict_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "configure: time_fields must be a dict");
        return -1;
    }
    memset(r->time_digit, 0, sizeof r->time_digit);
    for (int f = 0; f < N_TIME_FIELDS; f++) {
        PyObject *v = PyDict_GetItemString(fields, names[f]);
        Py_ssize_t at, width;
        if (v == NULL || !PyArg_ParseTuple(v, "nn", &at, &width)) {
            PyErr_Format(PyExc_ValueError, "configure: time_fields needs %s as (offset, width)", names[f]);
            return -1;
        }
        /* canonical_time reads a four-digit year and two-digit other fields. */
        if (width != (f == T_YEAR ? 4 : 2) || at < 0 || (size_t)(at + width) > r->time_layout.len) {
            PyErr_Format(PyExc_ValueError, "configure: time field %s does not fit the layout", names[f]);
            return -1;
        }
        for (Py_ssize_t k = at; k < at + width; k++) {
            if (r->time_digit[k]) {
                PyErr_SetString(PyExc_ValueError, "configure: time fields overlap");
                return -1;
            }
            r->time_digit[k] = 1;
        }
        r->time_at[f] = (size_t)at;
        r->time_width[f] = (size_t)width;
    }
    return 0;
}

static int rule_roles(PyObject *rules, Rules *r) {
    PyObject *roles = rule_item(rules, "roles"), *key, *value;
    Py_ssize_t pos = 0;
    if (roles == NULL)
        return -1;
    if (!PyDict_Check(roles) || PyDict_GET_SIZE(roles) > RULE_ROLES) {
        PyErr_Format(PyExc_ValueError, "configure: roles must be a dict of at most %d", RULE_ROLES);
        return -1;
    }
    r->n_roles = 0;
    while (PyDict_Next(roles, &pos, &key, &value)) {
        RoleRule *role = &r->roles[r->n_roles++];
        RuleText speaker;
        if (rule_text(key, "a role", LOWER, &role->name) < 0 || rule_text(value, "a role's speaker", ANY_CASE, &speaker) < 0)
            return -1;
        role->from = -1;
        for (int f = 0; f < N_FROM; f++)
            if (speaker.len == r->speakers[f].len && memcmp(speaker.s, r->speakers[f].s, speaker.len) == 0)
                role->from = f;
        if (role->from < 0) {
            PyErr_SetString(PyExc_ValueError, "configure: a role maps to a speaker not in speakers");
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(configure_doc,
             "configure(rules: dict) -> None\n\n"
             "Sets the format rules the decoder applies: capture.rules.native_table(). Until it is called,\n"
             "decode_chunk, decode_block and parse_times raise RuntimeError. A table it cannot take raises\n"
             "and leaves the rules as they were.");

static PyObject *configure(PyObject *self, PyObject *rules) {
    if (!PyDict_Check(rules)) {
        PyErr_SetString(PyExc_TypeError, "configure: the rules are a dict");
        return NULL;
    }
    Rules r;
    memset(&r, 0, sizeof r);
    if (rule_names(rules, "speakers", ANY_CASE, r.speakers, N_FROM) < 0 ||
        rule_names(rules, "formats", ANY_CASE, r.formats, N_FORMAT) < 0 ||
        rule_names(rules, "encodings", UPPER, r.encodings, N_KIND) < 0 || rule_roles(rules, &r) < 0 ||
        rule_str(rules, "csv_content_type", LOWER, &r.csv_content_type) < 0 ||
        rule_str(rules, "sse_content_type", LOWER, &r.sse_content_type) < 0 ||
        rule_str(rules, "sse_data", ANY_CASE, &r.sse_data) < 0 || rule_str(rules, "sse_head", ANY_CASE, &r.sse_head) < 0 ||
        rule_str(rules, "sse_sep", ANY_CASE, &r.sse_sep) < 0 || rule_str(rules, "sse_tail", ANY_CASE, &r.sse_tail) < 0 ||
        rule_time(rules, &r) < 0 || rule_range(rules, "temperature", &r.temperature_lo, &r.temperature_hi) < 0 ||
        rule_range(rules, "top_p", &r.top_p_lo, &r.top_p_hi) < 0 ||
        rule_names(rules, "max_tokens_keys", ANY_CASE, r.max_tokens_keys, N_MAX_TOKENS_KEYS) < 0 ||
        rule_names(rules, "plain_roles", ANY_CASE, r.plain_roles, N_PLAIN_ROLES) < 0)
        return NULL;
    /* canonical_sse finds separators at line breaks; an empty content type would match any. */
    if (r.sse_sep.len == 0 || r.sse_sep.s[0] != '\n' || r.sse_content_type.len == 0 || r.sse_data.len == 0) {
        PyErr_SetString(PyExc_ValueError, "configure: sse_sep must start with a line break; sse_content_type and "
                                          "sse_data must not be empty");
        return NULL;
    }
    r.configured = 1;
    RULES = r;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(isspace_doc, "isspace(code_point) -> bool: str.isspace() as the decoder models it (for tests).");

static PyObject *py_isspace_fn(PyObject *self, PyObject *arg) {
    unsigned long cp = PyLong_AsUnsignedLong(arg);
    if (cp == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(py_isspace((uint32_t)cp));
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_O, configure_doc},
    {"decode_chunk", decode_chunk, METH_VARARGS, decode_chunk_doc},
    {"decode_block", decode_block, METH_VARARGS, decode_block_doc},
    {"content_hashes", content_hashes, METH_VARARGS, content_hashes_doc},
    {"range_hashes", range_hashes, METH_VARARGS, range_hashes_doc},
    {"parse_times", parse_times, METH_VARARGS, parse_times_doc},
    {"redact_gate", redact_gate, METH_VARARGS, redact_gate_doc},
    {"redact_gate_json", redact_gate_json, METH_VARARGS, redact_gate_json_doc},
    {"digests_add_new", digests_add_new, METH_VARARGS, digests_add_new_doc},
    {"digests_contains", digests_contains_py, METH_VARARGS, digests_contains_doc},
    {"digests_rehash", py_digests_rehash, METH_VARARGS, digests_rehash_doc},
    {"blake2b16_many", py_blake2b16_many, METH_O, blake2b16_many_doc},
    {"isspace", py_isspace_fn, METH_O, isspace_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_capture_native",
    .m_doc = "Native decode-and-hash for capture ingest (see capture/native.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__capture_native(void) {
    if (PyType_Ready(&OwnedType) < 0)
        return NULL;
    return PyModule_Create(&module);
}
