/* capture.redact.GATE without a regex engine: a superset of its matches, in one pass.
 *
 * GATE's alternatives, and how each is found here:
 *   @                                     the byte itself
 *   A(?:KIA|SIA|GPA|IDA|ROA|IPA|NPA|NVA|BIA|CCA), AIza   at each 'A', the three bytes after it
 *   (?i:bearer)                           at each b/B before e/E
 *   sk-                                   at each '-', the two bytes before it
 *   gh[pousr]_, hf_, github_pat_          at each '_', the bytes before it
 *   xox                                   at each 'x' before 'o'
 *   (?i:api[_\-]?key|access[_\-]?token)   at each ke(y|n) in any case (key, token), the bytes around it
 *   [A-Za-z0-9/+]{40}                     the distance between bytes outside that class
 *   \d(?:[ \-]?\d){12,18}                 the length of the chain of digits ending at each digit
 *   \d{3}[ .\-)]{1,2}\d{3}                at the third digit of each run of digits, the bytes before it
 *   \+\d                                  at each '+'
 * \d and the classes are ASCII in RE2; (?i) folds k to the Kelvin sign (U+212A, E2 84 AA) and
 * s to the long s (U+017F, C5 BF) too (no other letter of the two words has a non-ASCII
 * fold): a string holding either is flagged outright, which keeps the result a superset.
 *
 * Bytes are classified 16 at a time (SSE2 where the compiler targets it, a table elsewhere),
 * in blocks of 32: one mask of the bytes that start a check ("triggers", rare in prose) and
 * one of the bytes of the 40-character class; the checks then look at the string's bytes.
 * Where the table stands in for SSE2, b, k and x trigger alone: more checks, same result. */
#include "gate.h"

#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline int is_digit(uint8_t c) { return (uint8_t)(c - '0') < 10; }
static inline int card_sep(uint8_t c) { return c == ' ' || c == '-'; }
static inline int phone_sep(uint8_t c) { return c == ' ' || c == '.' || c == '-' || c == ')'; }
static inline int label_sep(uint8_t c) { return c == '_' || c == '-'; }

/* s[i, i + len) is the lowercase ASCII word w in any ASCII case (w: letters only). */
static int word_at(const uint8_t *s, size_t n, ptrdiff_t i, const char *w, size_t len) {
    if (i < 0 || (size_t)i + len > n)
        return 0;
    for (size_t k = 0; k < len; k++)
        if ((s[i + k] | 0x20) != (uint8_t)w[k])
            return 0;
    return 1;
}

/* api[_\-]?key or access[_\-]?token, in any ASCII case, around the k at i. */
static int label_at(const uint8_t *s, size_t n, ptrdiff_t i) {
    if (word_at(s, n, i + 1, "ey", 2) &&
        (word_at(s, n, i - 3, "api", 3) || (i >= 4 && label_sep(s[i - 1]) && word_at(s, n, i - 4, "api", 3))))
        return 1;
    if (word_at(s, n, i + 1, "en", 2) && word_at(s, n, i - 2, "to", 2) &&
        (word_at(s, n, i - 8, "access", 6) || (i >= 9 && label_sep(s[i - 3]) && word_at(s, n, i - 9, "access", 6))))
        return 1;
    return 0;
}

/* A(?:KIA|SIA|GPA|IDA|ROA|IPA|NPA|NVA|BIA|CCA) or AIza at i (s[i] == 'A'). */
static int aws_at(const uint8_t *s, size_t n, size_t i) {
    static const char tails[][4] = {"KIA", "SIA", "GPA", "IDA", "ROA", "IPA", "NPA", "NVA", "BIA", "CCA", "Iza"};
    if (i + 4 > n)
        return 0;
    for (size_t t = 0; t < sizeof tails / sizeof tails[0]; t++)
        if (memcmp(s + i + 1, tails[t], 3) == 0)
            return 1;
    return 0;
}

/* The digits seen so far in one string. */
typedef struct {
    ptrdiff_t last; /* index of the last digit */
    int chain;      /* digits in the longest \d(?:[ \-]?\d)* ending there */
    int run;        /* digits in the run of digits ending there */
} Digits;

static int digit_at(const uint8_t *s, ptrdiff_t i, Digits *d) {
    if (d->last == i - 1) {
        d->chain++;
        d->run++;
    } else {
        d->chain = d->last == i - 2 && card_sep(s[i - 1]) ? d->chain + 1 : 1;
        d->run = 1;
    }
    d->last = i;
    if (d->chain >= 13)
        return 1;
    if (d->run == 3) {
        /* s[i-2, i] are the second \d{3}; s[i-3] is no digit: the separators end there. */
        ptrdiff_t j = i - 3;
        if (j >= 3 && phone_sep(s[j]) && is_digit(s[j - 1]) && is_digit(s[j - 2]) && is_digit(s[j - 3]))
            return 1;
        if (j >= 4 && phone_sep(s[j]) && phone_sep(s[j - 1]) && is_digit(s[j - 2]) && is_digit(s[j - 3]) &&
            is_digit(s[j - 4]))
            return 1;
    }
    return 0;
}

/* Whether an alternative of the gate matches at (or, looking back, ends at) trigger byte i. */
static int check_at(const uint8_t *s, size_t n, size_t i, Digits *d) {
    uint8_t c = s[i];
    if (is_digit(c))
        return digit_at(s, (ptrdiff_t)i, d);
    switch (c) {
    case '@':
        return 1;
    case 'A':
        return aws_at(s, n, i);
    case 'b':
    case 'B':
        return word_at(s, n, (ptrdiff_t)i, "bearer", 6);
    case 'k':
    case 'K':
        return label_at(s, n, (ptrdiff_t)i);
    case '-':
        return i >= 2 && s[i - 2] == 's' && s[i - 1] == 'k';
    case '_':
        if (i >= 3 && s[i - 3] == 'g' && s[i - 2] == 'h' &&
            (s[i - 1] == 'p' || s[i - 1] == 'o' || s[i - 1] == 'u' || s[i - 1] == 's' || s[i - 1] == 'r'))
            return 1;
        if (i >= 2 && s[i - 2] == 'h' && s[i - 1] == 'f')
            return 1;
        return i >= 10 && memcmp(s + i - 10, "github_pat", 10) == 0;
    case 'x':
        return i + 3 <= n && s[i + 1] == 'o' && s[i + 2] == 'x';
    case '+':
        return i + 2 <= n && is_digit(s[i + 1]);
    case 0xE2: /* U+212A KELVIN SIGN */
        return i + 3 <= n && s[i + 1] == 0x84 && s[i + 2] == 0xAA;
    case 0xC5: /* U+017F LATIN SMALL LETTER LONG S */
        return i + 2 <= n && s[i + 1] == 0xBF;
    }
    return 0;
}

#if defined(__SSE2__)

/* Classifies the 16 bytes at p (reading p[0, 18)): `trig`, a bit per byte that starts a check,
 * set for a superset of single bytes (digits, + @ A - _) and of pairs or triples rare in prose
 * (be(arer), ke(y|n) of key and token, xo(x), E2 84 of the Kelvin sign, C5 BF of the long s);
 * `run`, a bit per byte in [A-Za-z0-9/+]. Pairs compare case-folded bytes (b | 0x20), which
 * maps only the letters' cases together and a few other bytes onto others: a superset again. */
static inline void classify16(const uint8_t *p, uint32_t *trig, uint32_t *run) {
#define SET(c) _mm_set1_epi8((char)(c))
#define EQ(x, c) _mm_cmpeq_epi8(x, SET(c))
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m128i l0 = _mm_or_si128(v, SET(0x20));
    __m128i l1 = _mm_or_si128(_mm_loadu_si128((const __m128i *)(p + 1)), SET(0x20));
    __m128i l2 = _mm_or_si128(_mm_loadu_si128((const __m128i *)(p + 2)), SET(0x20));
    /* x in [lo, lo + k) as a signed compare: x + (0x80 - lo) < -128 + k */
    __m128i digit = _mm_cmplt_epi8(_mm_add_epi8(v, SET(0x80 - '0')), SET(-128 + 10));
    __m128i letter = _mm_cmplt_epi8(_mm_add_epi8(l0, SET(0x80 - 'a')), SET(-128 + 26));
    __m128i plus = EQ(v, '+');
    __m128i in_run = _mm_or_si128(_mm_or_si128(digit, letter), _mm_or_si128(plus, EQ(v, '/')));
    __m128i t = _mm_or_si128(_mm_or_si128(digit, plus), _mm_or_si128(EQ(v, '@'), EQ(v, 'A')));
    t = _mm_or_si128(t, _mm_or_si128(EQ(v, '-'), EQ(v, '_')));
    __m128i e1 = EQ(l1, 'e');
    t = _mm_or_si128(t, _mm_or_si128(_mm_and_si128(EQ(l0, 'b'), e1), _mm_and_si128(EQ(l0, 'x'), EQ(l1, 'o'))));
    t = _mm_or_si128(t, _mm_and_si128(_mm_and_si128(EQ(l0, 'k'), e1), _mm_or_si128(EQ(l2, 'y'), EQ(l2, 'n'))));
    t = _mm_or_si128(t, _mm_or_si128(_mm_and_si128(EQ(v, 0xE2), EQ(l1, 0x84 | 0x20)),
                                     _mm_and_si128(EQ(v, 0xC5), EQ(l1, 0xBF))));
#undef EQ
#undef SET
    *trig = (uint32_t)_mm_movemask_epi8(t);
    *run = (uint32_t)_mm_movemask_epi8(in_run);
}

#else

enum { C_TRIG = 1, C_RUN = 2 };

static uint8_t byte_class[256];

/* Single bytes only: b, k, x (either case), E2 and C5 start checks on their own here. */
static void classes_init(void) {
    for (int c = 0; c < 256; c++) {
        int lower = c | 0x20, digit = c >= '0' && c <= '9';
        int run = digit || (lower >= 'a' && lower <= 'z') || c == '/' || c == '+';
        int trig = digit || c == '+' || c == '@' || c == 'A' || lower == 'b' || lower == 'k' || c == '-' || c == '_' ||
                   lower == 'x' || c == 0xE2 || c == 0xC5;
        byte_class[c] = (uint8_t)((trig ? C_TRIG : 0) | (run ? C_RUN : 0));
    }
}

static inline void classify16(const uint8_t *p, uint32_t *trig, uint32_t *run) {
    uint32_t t = 0, r = 0;
    for (int k = 0; k < 16; k++) {
        uint8_t c = byte_class[p[k]];
        t |= (uint32_t)(c & C_TRIG) << k;
        r |= (uint32_t)((c & C_RUN) >> 1) << k;
    }
    *trig = t;
    *run = r;
}

#endif

int gate_match(const uint8_t *s, size_t n, const uint8_t *limit) {
#if !defined(__SSE2__)
    static int ready;
    if (!ready) {
        classes_init();
        ready = 1;
    }
#endif
    Digits d = {.last = -8, .chain = 0, .run = 0};
    ptrdiff_t last = -1; /* the last byte outside [A-Za-z0-9/+] */
    /* Blocks of 32 bytes: a run of 40 spans a whole block, so it is found where runs end (the
     * first byte outside the class in a block, or the end of the string) or in a block all
     * inside the class; trigger bytes are checked in order (the digit state needs that). */
    for (size_t k = 0; k < n; k += 32) {
        const uint8_t *p = s + k;
        uint8_t tail[64];
        if (limit - p < 34) { /* classifying reads p[0, 34) */
            memset(tail, 0, sizeof tail);
            memcpy(tail, p, n - k < 34 ? n - k : 34);
            p = tail;
        }
        uint32_t trig, t_hi, r_lo, r_hi;
        classify16(p, &trig, &r_lo);
        classify16(p + 16, &t_hi, &r_hi);
        trig |= t_hi << 16;
        uint32_t nonrun = ~(r_lo | r_hi << 16);
        if (n - k < 32) {
            uint32_t keep = (uint32_t)((1ull << (n - k)) - 1);
            trig &= keep;
            nonrun |= ~keep; /* the end of the string ends a run */
        }
        if (nonrun == 0) {
            if ((ptrdiff_t)k + 31 - last >= 40)
                return 1;
        } else {
            if ((ptrdiff_t)k + __builtin_ctz(nonrun) - 1 - last >= 40)
                return 1;
            last = (ptrdiff_t)k + 31 - __builtin_clz(nonrun);
        }
        while (trig) {
            size_t i = k + (size_t)__builtin_ctz(trig);
            trig &= trig - 1;
            if (check_at(s, n, i, &d))
                return 1;
        }
    }
    return 0;
}
