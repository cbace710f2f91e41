/* Strict JSON scanning; see json.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* ---- arena ------------------------------------------------------------------------ */

struct ArenaBlock {
    ArenaBlock *next;
    size_t used, cap;
    uint8_t data[];
};

#define ARENA_BLOCK (64 * 1024)

uint8_t *arena_reserve(Arena *a, size_t n) {
    ArenaBlock *b = a->head;
    if (b == NULL || b->cap - b->used < n) {
        size_t cap = n > ARENA_BLOCK ? n : ARENA_BLOCK;
        b = malloc(sizeof(ArenaBlock) + cap);
        if (b == NULL)
            return NULL;
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
    }
    return b->data + b->used;
}

void arena_commit(Arena *a, size_t n) { a->head->used += n; }

uint8_t *arena_alloc(Arena *a, size_t n) {
    uint8_t *out = arena_reserve(a, n);
    if (out != NULL)
        arena_commit(a, n);
    return out;
}

void arena_reset(Arena *a) {
    /* Keep one standard block for the next line; big lines' blocks go back. */
    ArenaBlock *keep = NULL;
    for (ArenaBlock *b = a->head, *next; b != NULL; b = next) {
        next = b->next;
        if (keep == NULL && b->cap == ARENA_BLOCK)
            keep = b;
        else
            free(b);
    }
    if (keep != NULL) {
        keep->used = 0;
        keep->next = NULL;
    }
    a->head = keep;
}

void arena_free(Arena *a) {
    for (ArenaBlock *b = a->head, *next; b != NULL; b = next) {
        next = b->next;
        free(b);
    }
    a->head = NULL;
}

/* ---- UTF-8 ------------------------------------------------------------------------ */

int utf8_char_len(const uint8_t *p, const uint8_t *end) {
    ptrdiff_t room = end - p;
    uint8_t c = p[0];
#define CONT(i) (room > (i) && (p[i] & 0xC0) == 0x80)
    if (c >= 0xC2 && c <= 0xDF)
        return CONT(1) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (room < 3 || !CONT(1) || !CONT(2))
            return 0;
        if (c == 0xE0 && p[1] < 0xA0)
            return 0; /* overlong */
        if (c == 0xED && p[1] > 0x9F)
            return 0; /* UTF-16 surrogates */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (room < 4 || !CONT(1) || !CONT(2) || !CONT(3))
            return 0;
        if (c == 0xF0 && p[1] < 0x90)
            return 0; /* overlong */
        if (c == 0xF4 && p[1] > 0x8F)
            return 0; /* beyond U+10FFFF */
        return 4;
    }
#undef CONT
    return 0;
}

int utf8_valid(const uint8_t *p, size_t n) {
    const uint8_t *end = p + n;
    while (p < end) {
        if (end - p >= 8) { /* ASCII a word at a time */
            uint64_t v;
            memcpy(&v, p, 8);
            if ((v & 0x8080808080808080ULL) == 0) {
                p += 8;
                continue;
            }
        }
        if (*p < 0x80) {
            p++;
            continue;
        }
        int k = utf8_char_len(p, end);
        if (k == 0)
            return 0;
        p += k;
    }
    return 1;
}

uint32_t utf8_decode(const uint8_t *p, int *len) {
    uint8_t c = p[0];
    if (c < 0x80) {
        *len = 1;
        return c;
    }
    if (c < 0xE0) {
        *len = 2;
        return ((uint32_t)(c & 0x1F) << 6) | (p[1] & 0x3F);
    }
    if (c < 0xF0) {
        *len = 3;
        return ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    }
    *len = 4;
    return ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(p[1] & 0x3F) << 12) | ((uint32_t)(p[2] & 0x3F) << 6) |
           (p[3] & 0x3F);
}

/* ---- strings ---------------------------------------------------------------------- */

/* True if none of the 8 bytes is '"', '\\', a control character or non-ASCII: the
 * common case, checked a word at a time (exact bit tricks, no false negatives). */
static inline int plain8(uint64_t v) {
    const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
    uint64_t quote = v ^ (ones * '"'), slash = v ^ (ones * '\\');
    uint64_t found = (v & high) | ((v - ones * 0x20) & ~v & high) | ((quote - ones) & ~quote & high) |
                     ((slash - ones) & ~slash & high);
    return found == 0;
}

static int hex4(const uint8_t *p, uint32_t *out) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        uint8_t c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= c - '0';
        else if (c >= 'a' && c <= 'f')
            v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            v |= c - 'A' + 10;
        else
            return 0;
    }
    *out = v;
    return 1;
}

/* Length of the escape at p ('\\'), or 0 if it is invalid or one this scanner
 * declines: \u0000 (NUL is junk to the decoders) and unpaired surrogates. */
static int escape_len(const uint8_t *p, const uint8_t *end, uint32_t *cp) {
    if (end - p < 2)
        return 0;
    switch (p[1]) {
    case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
        return 2;
    case 'u':
        break;
    default:
        return 0;
    }
    uint32_t hi, lo;
    if (end - p < 6 || !hex4(p + 2, &hi) || hi == 0)
        return 0;
    if (hi >= 0xDC00 && hi <= 0xDFFF)
        return 0;
    if (hi < 0xD800 || hi > 0xDBFF) {
        *cp = hi;
        return 6;
    }
    if (end - p < 12 || p[6] != '\\' || p[7] != 'u' || !hex4(p + 8, &lo) || lo < 0xDC00 || lo > 0xDFFF)
        return 0;
    *cp = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
    return 12;
}

static size_t put_utf8(uint8_t *dst, uint32_t cp) {
    if (cp < 0x80) {
        dst[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (uint8_t)(0xC0 | (cp >> 6));
        dst[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (uint8_t)(0xE0 | (cp >> 12));
        dst[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    dst[0] = (uint8_t)(0xF0 | (cp >> 18));
    dst[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    dst[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* What a byte inside a string needs: 0 nothing (plain ASCII), else a closer look. */
static uint8_t STRING_CLASS[256];
/* The byte a simple escape stands for; 1 for \u; 0 for an invalid escape. */
static uint8_t ESCAPED[256];

static void tables_init(void) {
    for (int c = 0; c < 256; c++)
        STRING_CLASS[c] = c < 0x20 || c == '"' || c == '\\' || c >= 0x80;
    ESCAPED['"'] = '"';
    ESCAPED['\\'] = '\\';
    ESCAPED['/'] = '/';
    ESCAPED['b'] = '\b';
    ESCAPED['f'] = '\f';
    ESCAPED['n'] = '\n';
    ESCAPED['r'] = '\r';
    ESCAPED['t'] = '\t';
    ESCAPED['u'] = 1;
}

static inline const uint8_t *skip_plain(const uint8_t *p, const uint8_t *end) {
#if defined(__SSE2__)
    /* 16 bytes at a time: a signed compare below 0x20 also catches every byte >= 0x80. */
    while (end - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        __m128i stop = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('"')),
                                                 _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'))),
                                    _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)));
        int mask = _mm_movemask_epi8(stop);
        if (mask)
            return p + __builtin_ctz((unsigned)mask);
        p += 16;
    }
#endif
    while (end - p >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        if (!plain8(v))
            break;
        p += 8;
    }
    while (p < end && !STRING_CLASS[*p])
        p++;
    return p;
}

static inline uint8_t *copy_run(uint8_t *o, const uint8_t *p, size_t n) {
    if (n < 16) { /* escape-dense text (JSON inside JSON): short runs, no call */
        for (size_t i = 0; i < n; i++)
            o[i] = p[i];
        return o + n;
    }
    memcpy(o, p, n);
    return o + n;
}

/* The body of a string from p, which holds a backslash, to its closing quote: validated,
 * and decoded to o unless o is NULL. Returns the closing quote, or NULL to decline;
 * *o_end gets the end of the decoded text. */
static const uint8_t *string_escaped(const uint8_t *p, const uint8_t *end, uint8_t *o, uint8_t **o_end) {
    for (;;) {
        const uint8_t *q = skip_plain(p, end);
        if (o != NULL)
            o = copy_run(o, p, (size_t)(q - p));
        p = q;
        if (p >= end)
            return NULL; /* unterminated */
        uint8_t c = *p;
        if (c == '"')
            break;
        if (c == '\\') {
            if (end - p < 2)
                return NULL;
            uint8_t e = ESCAPED[p[1]];
            if (e > 1) {
                if (o != NULL)
                    *o++ = e;
                p += 2;
                continue;
            }
            uint32_t cp = 0;
            int k = e == 1 ? escape_len(p, end, &cp) : 0;
            if (k == 0)
                return NULL;
            if (o != NULL)
                o += put_utf8(o, cp);
            p += k;
        } else if (c < 0x20) {
            return NULL; /* raw control character */
        } else {
            int k = utf8_char_len(p, end);
            if (k == 0)
                return NULL;
            if (o != NULL)
                o = copy_run(o, p, (size_t)k);
            p += k;
        }
    }
    *o_end = o;
    return p;
}

int json_string(Scan *s, Arena *a, Span *out) {
    const uint8_t *start = s->p + 1, *p = start, *end = s->end;
    if (STRING_CLASS['"'] == 0)
        tables_init();
    /* Plain text up to the first escape: most strings end here, as a slice of the input. */
    for (;;) {
        p = skip_plain(p, end);
        if (p >= end)
            return J_DECLINE;
        uint8_t c = *p;
        if (c == '"' || c == '\\')
            break;
        if (c < 0x20)
            return J_DECLINE;
        int k = utf8_char_len(p, end);
        if (k == 0)
            return J_DECLINE;
        p += k;
    }
    if (*p == '"') {
        s->p = p + 1;
        if (out != NULL) {
            out->ptr = start;
            out->len = (size_t)(p - start);
        }
        return J_OK;
    }
    uint8_t *dst = NULL, *dst_end = NULL;
    if (out != NULL) {
        if (a == NULL)
            return J_DECLINE; /* keys are matched as written */
        /* Decoded text is never longer than its escaped form: room for the rest of the input. */
        dst = arena_reserve(a, (size_t)(end - start));
        if (dst == NULL)
            return J_NOMEM;
        memcpy(dst, start, (size_t)(p - start));
    }
    const uint8_t *quote = string_escaped(p, end, dst ? dst + (p - start) : NULL, &dst_end);
    if (quote == NULL)
        return J_DECLINE;
    s->p = quote + 1;
    if (out != NULL) {
        arena_commit(a, (size_t)(dst_end - dst));
        out->ptr = dst;
        out->len = (size_t)(dst_end - dst);
    }
    return J_OK;
}

/* ---- numbers ---------------------------------------------------------------------- */

static inline int is_digit(int c) { return c >= '0' && c <= '9'; }

int json_number(Scan *s, Span *lit, int *integral) {
    const uint8_t *p = s->p, *end = s->end;
    *integral = 1;
    if (p < end && *p == '-')
        p++;
    if (p >= end)
        return J_DECLINE;
    if (*p == '0')
        p++;
    else if (*p >= '1' && *p <= '9')
        while (p < end && is_digit(*p))
            p++;
    else
        return J_DECLINE;
    if (p < end && *p == '.') {
        *integral = 0;
        p++;
        if (p >= end || !is_digit(*p))
            return J_DECLINE;
        while (p < end && is_digit(*p))
            p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        *integral = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-'))
            p++;
        if (p >= end || !is_digit(*p))
            return J_DECLINE;
        while (p < end && is_digit(*p))
            p++;
    }
    lit->ptr = s->p;
    lit->len = (size_t)(p - s->p);
    s->p = p;
    return J_OK;
}

int json_int64(Scan *s, int64_t *out) {
    Span lit;
    int integral;
    if (json_peek(s) != '-' && !is_digit(json_peek(s)))
        return J_DECLINE;
    if (json_number(s, &lit, &integral) != J_OK || !integral)
        return J_DECLINE; /* msgspec rejects 12.0 and 1e2 for int fields */
    const uint8_t *p = lit.ptr, *end = lit.ptr + lit.len;
    int negative = *p == '-';
    p += negative;
    if (end - p > 19)
        return J_DECLINE;
    uint64_t v = 0;
    for (; p < end; p++)
        v = v * 10 + (uint64_t)(*p - '0'); /* at most 19 digits: no uint64 overflow */
    if (negative) {
        if (v > (uint64_t)INT64_MAX + 1)
            return J_DECLINE;
        *out = v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v;
    } else {
        if (v > (uint64_t)INT64_MAX)
            return J_DECLINE;
        *out = (int64_t)v;
    }
    return J_OK;
}

int json_opt_int64(Scan *s, OptI64 *out) {
    out->has = 0;
    if (json_null(s))
        return J_OK;
    out->has = 1;
    return json_int64(s, &out->v);
}

int json_opt_double(Scan *s, OptF64 *out) {
    out->has = 0;
    if (json_null(s))
        return J_OK;
    Span lit;
    int integral;
    if (json_peek(s) != '-' && !is_digit(json_peek(s)))
        return J_DECLINE; /* booleans and strings are not numbers to msgspec */
    if (json_number(s, &lit, &integral) != J_OK || lit.len > 64)
        return J_DECLINE;
    /* Python's own correctly rounded, locale-independent conversion (msgspec's is too). */
    char buf[72];
    memcpy(buf, lit.ptr, lit.len);
    buf[lit.len] = '\0';
    char *stop = NULL;
    double v = PyOS_string_to_double(buf, &stop, NULL);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return J_DECLINE;
    }
    if (stop != buf + lit.len || !isfinite(v))
        return J_DECLINE; /* msgspec: "Number out of range" */
    out->has = 1;
    out->v = v;
    return J_OK;
}

/* ---- structure -------------------------------------------------------------------- */

int json_null(Scan *s) {
    if (s->end - s->p >= 4 && memcmp(s->p, "null", 4) == 0) {
        s->p += 4;
        return 1;
    }
    return 0;
}

static int json_word(Scan *s, const char *word, size_t n) {
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0)
        return J_DECLINE;
    s->p += n;
    return J_OK;
}

/* The step to the next member or element of a container: 0 past its `close`, 1 at the next
 * one (after the ',' that must separate it from the one before), or J_DECLINE. */
static int json_next(Scan *s, int *count, int close) {
    json_ws(s);
    if (json_peek(s) == close) {
        s->p++;
        return 0;
    }
    if (*count > 0) {
        if (json_peek(s) != ',')
            return J_DECLINE;
        s->p++;
        json_ws(s);
    }
    (*count)++;
    return 1;
}

int json_member(Scan *s, int *count, Span *key) {
    int r = json_next(s, count, '}');
    if (r != 1)
        return r;
    if (json_peek(s) != '"')
        return J_DECLINE;
    if ((r = json_string(s, NULL, key)) != J_OK)
        return r;
    json_ws(s);
    if (json_peek(s) != ':')
        return J_DECLINE;
    s->p++;
    json_ws(s);
    return 1;
}

int json_element(Scan *s, int *count) { return json_next(s, count, ']'); }

int json_skip(Scan *s, int depth) {
    if (depth > JSON_MAX_DEPTH)
        return J_DECLINE;
    int c = json_peek(s), r, n = 0;
    Span key, lit;
    switch (c) {
    case '"':
        return json_string(s, NULL, NULL);
    case '{':
        s->p++;
        while ((r = json_member(s, &n, &key)) == 1)
            if ((r = json_skip(s, depth + 1)) != J_OK)
                return r;
        return r;
    case '[':
        s->p++;
        while ((r = json_element(s, &n)) == 1)
            if ((r = json_skip(s, depth + 1)) != J_OK)
                return r;
        return r;
    case 't':
        return json_word(s, "true", 4);
    case 'f':
        return json_word(s, "false", 5);
    case 'n':
        return json_word(s, "null", 4);
    default:
        if (c == '-' || is_digit(c))
            return json_number(s, &lit, &n);
        return J_DECLINE;
    }
}

int json_str(Scan *s, Arena *a, Span *out) {
    if (json_peek(s) != '"')
        return J_DECLINE;
    return json_string(s, a, out);
}

int json_opt_str(Scan *s, Arena *a, Span *out) {
    if (json_null(s)) {
        out->ptr = NULL;
        out->len = 0;
        return J_OK;
    }
    return json_str(s, a, out);
}
