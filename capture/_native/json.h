/* A strict, bounds-checked JSON scanner (RFC 8259) over UTF-8 bytes.
 *
 * It never guesses: anything outside plain JSON, or that the msgspec decoders might
 * treat differently (escaped keys, \u0000, lone surrogates, invalid UTF-8, nesting
 * deeper than JSON_MAX_DEPTH, numbers outside int64 or a double), makes a step return
 * J_DECLINE, and the caller leaves the whole line to the Python paths.
 */
#ifndef CAPTURE_JSON_H
#define CAPTURE_JSON_H

#include <stddef.h>
#include <stdint.h>

enum { J_OK = 0, J_DECLINE = -1, J_NOMEM = -2 };

/* Nesting below this is declined (the typed decoders need about 8 levels). */
#define JSON_MAX_DEPTH 32

/* A run of UTF-8 bytes; ptr == NULL stands for JSON null or an absent field. */
typedef struct {
    const uint8_t *ptr;
    size_t len;
} Span;

/* Bump allocator for decoded strings of one line: blocks never move, so Spans into
 * them stay valid until arena_reset. */
typedef struct ArenaBlock ArenaBlock;
typedef struct {
    ArenaBlock *head;
} Arena;

uint8_t *arena_alloc(Arena *a, size_t n);
/* Room for up to n bytes at the arena's end, of which arena_commit keeps the first few. */
uint8_t *arena_reserve(Arena *a, size_t n);
void arena_commit(Arena *a, size_t n);
void arena_reset(Arena *a);
void arena_free(Arena *a);

typedef struct {
    const uint8_t *p, *end;
} Scan;

static inline void json_ws(Scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\n' || *s->p == '\r' || *s->p == '\t'))
        s->p++;
}

static inline int json_peek(const Scan *s) { return s->p < s->end ? *s->p : -1; }

/* String at the cursor. out == NULL: validate and skip. Otherwise *out is the decoded
 * text: a slice of the input when it holds no escape, else a copy in the arena (with
 * a == NULL an escape declines: keys are matched as written). */
int json_string(Scan *s, Arena *a, Span *out);
/* Number at the cursor; *lit is its text, *integral whether it has no fraction/exponent. */
int json_number(Scan *s, Span *lit, int *integral);
/* Any value at the cursor, validated and skipped. */
int json_skip(Scan *s, int depth);
/* Object members, after the '{': 1 with *key read and the cursor on its value, 0 once
 * the object is closed, or an error. *count starts at 0. */
int json_member(Scan *s, int *count, Span *key);
/* Array elements, after the '[': 1 with the cursor on the next element, 0 once closed. */
int json_element(Scan *s, int *count);
/* Consumes a literal null if one is at the cursor. */
int json_null(Scan *s);

/* Typed values as msgspec decodes them; "opt" also takes null (then ptr/has is 0). */
int json_str(Scan *s, Arena *a, Span *out);
int json_opt_str(Scan *s, Arena *a, Span *out);
typedef struct { int has; double v; } OptF64;
typedef struct { int has; int64_t v; } OptI64;
int json_int64(Scan *s, int64_t *out);
int json_opt_int64(Scan *s, OptI64 *out);
int json_opt_double(Scan *s, OptF64 *out);

/* Length of the valid UTF-8 character at p (first byte >= 0x80), or 0 if invalid. */
int utf8_char_len(const uint8_t *p, const uint8_t *end);
/* Whole buffer valid UTF-8 (as Python's strict decoder requires)? */
int utf8_valid(const uint8_t *p, size_t n);
/* Code point at p in valid UTF-8; *len gets its byte length. */
uint32_t utf8_decode(const uint8_t *p, int *len);

#endif
