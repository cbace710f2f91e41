/* Growable buffers laid out as Arrow columns (offsets + data, validity bitmaps). */
#ifndef CAPTURE_COLUMNS_H
#define CAPTURE_COLUMNS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

typedef struct {
    uint8_t *data;
    size_t len, cap;
} Buf;

static inline int buf_reserve(Buf *b, size_t extra) {
    if (b->cap - b->len >= extra)
        return J_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len < extra)
        cap *= 2;
    uint8_t *d = realloc(b->data, cap);
    if (d == NULL)
        return J_NOMEM;
    b->data = d;
    b->cap = cap;
    return J_OK;
}

static inline int buf_put(Buf *b, const void *src, size_t n) {
    if (buf_reserve(b, n) != J_OK)
        return J_NOMEM;
    if (n)
        memcpy(b->data + b->len, src, n);
    b->len += n;
    return J_OK;
}

static inline void buf_free(Buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* Appends bit `on` as element `index` of a bitmap (Arrow: least significant bit first). */
static inline int bitmap_append(Buf *b, int64_t index, int on) {
    if ((index & 7) == 0) {
        uint8_t zero = 0;
        if (buf_put(b, &zero, 1) != J_OK)
            return J_NOMEM;
    }
    if (on)
        b->data[index >> 3] |= (uint8_t)(1u << (index & 7));
    return J_OK;
}

/* An Arrow utf8 column: int32 offsets, bytes, validity. */
typedef struct {
    Buf offsets, data, validity;
    int64_t length, nulls;
} StrCol;

/* Arrow's utf8 type addresses its bytes with int32 offsets. */
#define STR_COL_MAX_BYTES ((size_t)INT32_MAX)

static inline int str_col_init(StrCol *c) {
    int32_t zero = 0;
    return buf_put(&c->offsets, &zero, sizeof zero);
}

/* Appends the concatenation of pieces[0..n) (n == 0 with null: a null). */
static inline int str_col_append(StrCol *c, const Span *pieces, size_t n, int null) {
    for (size_t i = 0; i < n; i++) {
        if (pieces[i].len > STR_COL_MAX_BYTES - c->data.len)
            return J_NOMEM;
        if (buf_put(&c->data, pieces[i].ptr, pieces[i].len) != J_OK)
            return J_NOMEM;
    }
    int32_t end = (int32_t)c->data.len;
    if (buf_put(&c->offsets, &end, sizeof end) != J_OK || bitmap_append(&c->validity, c->length, !null) != J_OK)
        return J_NOMEM;
    c->nulls += null;
    c->length++;
    return J_OK;
}

static inline int str_col_span(StrCol *c, Span v) { return str_col_append(c, &v, v.ptr != NULL, v.ptr == NULL); }

static inline void str_col_free(StrCol *c) {
    buf_free(&c->offsets);
    buf_free(&c->data);
    buf_free(&c->validity);
}

/* A fixed-width Arrow column (float64 or int64) with validity. */
typedef struct {
    Buf values, validity;
    int64_t length, nulls;
} FixedCol;

static inline int fixed_col_append(FixedCol *c, const void *value, size_t width, int has) {
    uint8_t zero[8] = {0};
    if (buf_put(&c->values, has ? value : zero, width) != J_OK || bitmap_append(&c->validity, c->length, has) != J_OK)
        return J_NOMEM;
    c->nulls += !has;
    c->length++;
    return J_OK;
}

static inline void fixed_col_free(FixedCol *c) {
    buf_free(&c->values);
    buf_free(&c->validity);
}

/* ---- canonical JSON text (json.c) ------------------------------------------------ */

/* The value at the cursor as json.dumps(value, ensure_ascii=False) writes the parsed value:
 * separators "," and ":" (pretty: json.dumps' default ", " and ": "). Declines what it does
 * not reproduce exactly: floats, repeated keys, \u0000, lone surrogates, deep nesting. */
int json_canon(Scan *s, Buf *out, int depth, int pretty);
/* Decoded text (valid UTF-8) as a JSON string, as json.dumps(ensure_ascii=False) writes it. */
int json_canon_text(const uint8_t *p, size_t n, Buf *out);
/* The same without the quotes (a string written in pieces). */
int json_escape_text(const uint8_t *p, size_t n, Buf *out);
/* vLLM's token ids: null (*has = 0) or a list of ints in [0, 2**31) appended to out as int32;
 * anything else declines. */
int json_token_ids(Scan *s, Buf *out, int *has);
/* 1 if the text is one JSON document (json.loads would take it) by this scanner's strict rules. */
int json_valid_document(const uint8_t *p, size_t n);

#endif
