/* Strict JSON scanning; see json.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "columns.h"
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

/* ---- canonical JSON (json.dumps(v, ensure_ascii=False) of the parsed value) ---------- */

static int canon_put(Buf *out, const void *p, size_t n) { return buf_put(out, p, n); }

/* A string at the cursor, decoded and escaped again as json.dumps(ensure_ascii=False) does:
 * '"' and '\\' and the control characters escaped (\n \r \t \b \f by name, the others as
 * \u00xx), everything else raw UTF-8. */
static int canon_string(Scan *s, Buf *out) {
    static const char hex[] = "0123456789abcdef";
    if (STRING_CLASS['"'] == 0)
        tables_init();
    const uint8_t *p = s->p + 1, *end = s->end;
    if (canon_put(out, "\"", 1) != J_OK)
        return J_NOMEM;
    for (;;) {
        const uint8_t *q = skip_plain(p, end);
        if (q > p && canon_put(out, p, (size_t)(q - p)) != J_OK)
            return J_NOMEM;
        p = q;
        if (p >= end)
            return J_DECLINE;
        uint8_t c = *p;
        if (c == '"')
            break;
        if (c < 0x20)
            return J_DECLINE; /* raw control character */
        if (c >= 0x80) {
            int k = utf8_char_len(p, end);
            if (k == 0)
                return J_DECLINE;
            if (canon_put(out, p, (size_t)k) != J_OK)
                return J_NOMEM;
            p += k;
            continue;
        }
        /* a backslash */
        if (end - p < 2)
            return J_DECLINE;
        uint32_t cp;
        int k;
        switch (p[1]) {
        case '"': case '\\': case 'b': case 'f': case 'n': case 'r': case 't':
            if (canon_put(out, p, 2) != J_OK)
                return J_NOMEM;
            p += 2;
            continue;
        case '/':
            if (canon_put(out, "/", 1) != J_OK)
                return J_NOMEM;
            p += 2;
            continue;
        case 'u':
            k = escape_len(p, end, &cp); /* declines \u0000 and lone surrogates */
            if (k == 0)
                return J_DECLINE;
            p += k;
            break;
        default:
            return J_DECLINE;
        }
        uint8_t buf[8];
        size_t n;
        switch (cp) {
        case '"': n = 2; memcpy(buf, "\\\"", 2); break;
        case '\\': n = 2; memcpy(buf, "\\\\", 2); break;
        case '\b': n = 2; memcpy(buf, "\\b", 2); break;
        case '\f': n = 2; memcpy(buf, "\\f", 2); break;
        case '\n': n = 2; memcpy(buf, "\\n", 2); break;
        case '\r': n = 2; memcpy(buf, "\\r", 2); break;
        case '\t': n = 2; memcpy(buf, "\\t", 2); break;
        default:
            if (cp < 0x20) {
                memcpy(buf, "\\u00", 4);
                buf[4] = (uint8_t)hex[cp >> 4];
                buf[5] = (uint8_t)hex[cp & 15];
                n = 6;
            } else {
                n = put_utf8(buf, cp);
            }
        }
        if (canon_put(out, buf, n) != J_OK)
            return J_NOMEM;
    }
    s->p = p + 1;
    return canon_put(out, "\"", 1);
}

int json_escape_text(const uint8_t *p, size_t n, Buf *out) {
    /* Decoded text has no escapes but may hold '"', '\\' and control characters. */
    static const char hex[] = "0123456789abcdef";
    const uint8_t *end = p + n, *run = p;
    for (; p < end; p++) {
        uint8_t c = *p;
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        if (p > run && canon_put(out, run, (size_t)(p - run)) != J_OK)
            return J_NOMEM;
        uint8_t buf[6] = {'\\', 0};
        size_t k = 2;
        switch (c) {
        case '"': buf[1] = '"'; break;
        case '\\': buf[1] = '\\'; break;
        case '\b': buf[1] = 'b'; break;
        case '\f': buf[1] = 'f'; break;
        case '\n': buf[1] = 'n'; break;
        case '\r': buf[1] = 'r'; break;
        case '\t': buf[1] = 't'; break;
        default:
            memcpy(buf, "\\u00", 4);
            buf[4] = (uint8_t)hex[c >> 4];
            buf[5] = (uint8_t)hex[c & 15];
            k = 6;
        }
        if (canon_put(out, buf, k) != J_OK)
            return J_NOMEM;
        run = p + 1;
    }
    if (p > run && canon_put(out, run, (size_t)(p - run)) != J_OK)
        return J_NOMEM;
    return J_OK;
}

int json_canon_text(const uint8_t *p, size_t n, Buf *out) {
    if (canon_put(out, "\"", 1) != J_OK || json_escape_text(p, n, out) != J_OK)
        return J_NOMEM;
    return canon_put(out, "\"", 1);
}

/* Keys of one object whose duplicates are looked for; more are declined. */
#define CANON_MAX_KEYS 64

int json_canon(Scan *s, Buf *out, int depth, int pretty) {
    if (depth > JSON_MAX_DEPTH)
        return J_DECLINE;
    int c = json_peek(s), r, n = 0;
    switch (c) {
    case '"':
        return canon_string(s, out);
    case '[':
        s->p++;
        if (canon_put(out, "[", 1) != J_OK)
            return J_NOMEM;
        while ((r = json_element(s, &n)) == 1) {
            if (n > 1 && canon_put(out, pretty ? ", " : ",", pretty ? 2 : 1) != J_OK)
                return J_NOMEM;
            if ((r = json_canon(s, out, depth + 1, pretty)) != J_OK)
                return r;
        }
        if (r != J_OK)
            return r;
        return canon_put(out, "]", 1);
    case '{': {
        s->p++;
        if (canon_put(out, "{", 1) != J_OK)
            return J_NOMEM;
        size_t key_at[CANON_MAX_KEYS], key_len[CANON_MAX_KEYS];
        for (;;) {
            r = json_next(s, &n, '}');
            if (r == 0)
                break;
            if (r != 1)
                return r;
            if (n > CANON_MAX_KEYS || json_peek(s) != '"')
                return J_DECLINE;
            if (n > 1 && canon_put(out, pretty ? ", " : ",", pretty ? 2 : 1) != J_OK)
                return J_NOMEM;
            size_t at = out->len;
            if ((r = canon_string(s, out)) != J_OK)
                return r;
            size_t len = out->len - at;
            /* json.loads keeps a repeated key's first place and last value: not reproduced. */
            for (int i = 0; i < n - 1; i++)
                if (key_len[i] == len && memcmp(out->data + key_at[i], out->data + at, len) == 0)
                    return J_DECLINE;
            key_at[n - 1] = at;
            key_len[n - 1] = len;
            json_ws(s);
            if (json_peek(s) != ':')
                return J_DECLINE;
            s->p++;
            json_ws(s);
            if (canon_put(out, pretty ? ": " : ":", pretty ? 2 : 1) != J_OK)
                return J_NOMEM;
            if ((r = json_canon(s, out, depth + 1, pretty)) != J_OK)
                return r;
        }
        return canon_put(out, "}", 1);
    }
    case 't':
        if ((r = json_word(s, "true", 4)) != J_OK)
            return r;
        return canon_put(out, "true", 4);
    case 'f':
        if ((r = json_word(s, "false", 5)) != J_OK)
            return r;
        return canon_put(out, "false", 5);
    case 'n':
        if ((r = json_word(s, "null", 4)) != J_OK)
            return r;
        return canon_put(out, "null", 4);
    default: {
        Span lit;
        int integral;
        if (!(c == '-' || is_digit(c)) || json_number(s, &lit, &integral) != J_OK)
            return J_DECLINE;
        /* Floats (repr of the nearest double) are not reproduced; integers are printed as
         * written, but for "-0" (Python's 0) and lengths near Python's int-string limit. */
        if (!integral || lit.len > 1000)
            return J_DECLINE;
        if (lit.len == 2 && lit.ptr[0] == '-' && lit.ptr[1] == '0')
            return canon_put(out, "0", 1);
        return canon_put(out, lit.ptr, lit.len);
    }
    }
}

int json_token_ids(Scan *s, Buf *out, int *has) {
    *has = 0;
    if (json_null(s))
        return J_OK;
    if (json_peek(s) != '[')
        return J_DECLINE;
    s->p++;
    int n = 0, r;
    while ((r = json_element(s, &n)) == 1) {
        const uint8_t *p = s->p, *end = s->end;
        if (p >= end || !is_digit(*p))
            return J_DECLINE; /* negative, or not a number: the reference quarantines or decides */
        uint64_t v = 0;
        const uint8_t *start = p;
        while (p < end && is_digit(*p) && p - start < 11)
            v = v * 10 + (uint64_t)(*p++ - '0');
        if ((p - start > 1 && *start == '0') || (p < end && (is_digit(*p) || *p == '.' || *p == 'e' || *p == 'E')))
            return J_DECLINE;
        if (v > INT32_MAX)
            return J_DECLINE;
        int32_t id = (int32_t)v;
        if (buf_put(out, &id, sizeof id) != J_OK)
            return J_NOMEM;
        s->p = p;
    }
    if (r != J_OK)
        return r;
    *has = 1;
    return J_OK;
}

int json_valid_document(const uint8_t *p, size_t n) {
    Scan s = {p, p + n};
    json_ws(&s);
    if (json_skip(&s, 0) != J_OK)
        return 0;
    json_ws(&s);
    return s.p == s.end;
}
