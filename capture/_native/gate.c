/* capture.redact.GATE without a regex engine: a superset of its matches, in one pass.
 *
 * GATE's alternatives, and how each is found here:
 *   @                                     the byte itself
 *   A(?:KIA|SIA|GPA|IDA|ROA|IPA|NPA|NVA|BIA|CCA), AIza   at each 'A', the three bytes after it
 *   (?i:bearer), (?i:basic)[\t\n\v\f\r ]+[a-z]*[A-Z0-9+/=]   at each b/B before e/E or a/A, the bytes after
 *   sk-, glpat-, -----BEGIN               at each '-', the bytes before it (after it, for BEGIN)
 *   gh[pousr]_, hf_, github_pat_, npm_, [sr]k_(?:live|test)_   at each '_', the bytes before it
 *   xox                                   at each 'x' before 'o'
 *   eyJ                                   at each e/E before y/Y and j/J
 *   SG\.                                  at each 'S' before g/G and '.'
 *   (?i:passw(?:or)?d|pwd)\"?[\t\n\v\f\r ]*[:=]   at the first s of each "ssw", the p of each "pwd",
 *                                         in any case, and the bytes after the word
 *   (?i:api[_\-]?key|access[_\-]?token)   at each ke(y|n) in any case (key, token), the bytes around it
 *   [A-Za-z0-9/+]{40}                     the distance between bytes outside that class
 *   \d(?:[ \-]?\d){12,18}                 the length of the chain of digits ending at each digit
 *   \d{3}[ .\-)]{1,2}\d{3}                at the third digit of each run of digits, the bytes before it
 *   \d{3}-\d{2}-\d{4}                     at the fourth digit of each run, the bytes before it
 *   [A-Z]{2}\d{2} ?[A-Z0-9]{4}            at the second digit of each run, the bytes around it
 *   \+\d                                  at each '+'
 * \d and the classes are ASCII in RE2; (?i) folds k to the Kelvin sign (U+212A, E2 84 AA) and
 * s to the long s (U+017F, C5 BF) too (no other letter of GATE's words has a non-ASCII fold):
 * a string holding either is flagged outright, which keeps the result a superset.
 *
 * Bytes are classified 16 at a time (SSE2 where the compiler targets it, a scalar loop with the
 * same rule elsewhere), in blocks of 32: one mask of the bytes that start a check ("triggers",
 * rare in prose) and one of the bytes of the 40-character class; the checks then look at the
 * string's bytes. */
#include "gate.h"

#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline int is_digit(uint8_t c) { return (uint8_t)(c - '0') < 10; }
static inline int is_upper(uint8_t c) { return (uint8_t)(c - 'A') < 26; }
static inline int is_upper_or_digit(uint8_t c) { return is_upper(c) || is_digit(c); }
static inline int card_sep(uint8_t c) { return c == ' ' || c == '-'; }
static inline int phone_sep(uint8_t c) { return c == ' ' || c == '.' || c == '-' || c == ')'; }
static inline int label_sep(uint8_t c) { return c == '_' || c == '-'; }
/* RE2's \s lacks \v; the redactor's (Python's) has it, so GATE spells the blanks out. */
static inline int is_blank(uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

/* s[i, i + len) is the lowercase ASCII word w in any ASCII case (w: letters only). */
static int word_at(const uint8_t *s, size_t n, ptrdiff_t i, const char *w, size_t len) {
    if (i < 0 || (size_t)i + len > n)
        return 0;
    for (size_t k = 0; k < len; k++)
        if ((s[i + k] | 0x20) != (uint8_t)w[k])
            return 0;
    return 1;
}

/* s[i - len, i) is exactly w. */
static int before(const uint8_t *s, size_t i, const char *w, size_t len) {
    return i >= len && memcmp(s + i - len, w, len) == 0;
}

/* (?i:basic)[\t\n\v\f\r ]+[a-z]*[A-Z0-9+/=] at i: "basic" and a token that is no lowercase word. */
static int basic_at(const uint8_t *s, size_t n, size_t i) {
    if (!word_at(s, n, (ptrdiff_t)i, "basic", 5))
        return 0;
    size_t k = i + 5;
    while (k < n && is_blank(s[k]))
        k++;
    if (k == i + 5)
        return 0;
    while (k < n && (uint8_t)(s[k] - 'a') < 26)
        k++;
    return k < n && (is_upper_or_digit(s[k]) || s[k] == '+' || s[k] == '/' || s[k] == '=');
}

/* \"?[\t\n\v\f\r ]*[:=] at k: what follows a password label. */
static int assigned_at(const uint8_t *s, size_t n, size_t k) {
    if (k < n && s[k] == '"')
        k++;
    while (k < n && is_blank(s[k]))
        k++;
    return k < n && (s[k] == ':' || s[k] == '=');
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

static int digit_at(const uint8_t *s, size_t n, ptrdiff_t i, Digits *d) {
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
    if (d->run == 2 && i >= 3 && is_upper(s[i - 2]) && is_upper(s[i - 3])) {
        /* [A-Z]{2}\d{2} ?[A-Z0-9]{4}: an IBAN's country, check digits and first group */
        size_t j = (size_t)i + 1;
        if (j < n && s[j] == ' ')
            j++;
        if (j + 4 <= n && is_upper_or_digit(s[j]) && is_upper_or_digit(s[j + 1]) && is_upper_or_digit(s[j + 2]) &&
            is_upper_or_digit(s[j + 3]))
            return 1;
    }
    if (d->run == 3) {
        /* s[i-2, i] are the second \d{3}; s[i-3] is no digit: the separators end there. */
        ptrdiff_t j = i - 3;
        if (j >= 3 && phone_sep(s[j]) && is_digit(s[j - 1]) && is_digit(s[j - 2]) && is_digit(s[j - 3]))
            return 1;
        if (j >= 4 && phone_sep(s[j]) && phone_sep(s[j - 1]) && is_digit(s[j - 2]) && is_digit(s[j - 3]) &&
            is_digit(s[j - 4]))
            return 1;
    }
    /* \d{3}-\d{2}-\d{4} (a US SSN): s[i-3, i] are the \d{4} */
    return d->run == 4 && i >= 10 && s[i - 4] == '-' && is_digit(s[i - 5]) && is_digit(s[i - 6]) &&
           s[i - 7] == '-' && is_digit(s[i - 8]) && is_digit(s[i - 9]) && is_digit(s[i - 10]);
}

/* Whether an alternative of the gate matches at (or, looking back, ends at) trigger byte i. */
static int check_at(const uint8_t *s, size_t n, size_t i, Digits *d) {
    uint8_t c = s[i];
    if (is_digit(c))
        return digit_at(s, n, (ptrdiff_t)i, d);
    switch (c) {
    case '@':
        return 1;
    case 'A':
        return aws_at(s, n, i);
    case 'b':
    case 'B':
        return word_at(s, n, (ptrdiff_t)i, "bearer", 6) || basic_at(s, n, i);
    case 'k':
    case 'K':
        return label_at(s, n, (ptrdiff_t)i);
    case 'e':
        return i + 3 <= n && s[i + 1] == 'y' && s[i + 2] == 'J';
    case 'S':
        if (i + 3 <= n && s[i + 1] == 'G' && s[i + 2] == '.')
            return 1;
        /* fall through: S may also be the first s of "ssw" */
    case 's':
        return (word_at(s, n, (ptrdiff_t)i - 2, "password", 8) && assigned_at(s, n, i + 6)) ||
               (word_at(s, n, (ptrdiff_t)i - 2, "passwd", 6) && assigned_at(s, n, i + 4));
    case 'p':
    case 'P':
        return word_at(s, n, (ptrdiff_t)i, "pwd", 3) && assigned_at(s, n, i + 3);
    case '-':
        return before(s, i, "sk", 2) || before(s, i, "glpat", 5) ||
               (i + 11 <= n && memcmp(s + i, "-----BEGIN ", 11) == 0);
    case '_':
        if (i >= 3 && s[i - 3] == 'g' && s[i - 2] == 'h' &&
            (s[i - 1] == 'p' || s[i - 1] == 'o' || s[i - 1] == 'u' || s[i - 1] == 's' || s[i - 1] == 'r'))
            return 1;
        return before(s, i, "hf", 2) || before(s, i, "github_pat", 10) || before(s, i, "npm", 3) ||
               before(s, i, "sk_live", 7) || before(s, i, "rk_live", 7) || before(s, i, "sk_test", 7) ||
               before(s, i, "rk_test", 7);
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

/* The trigger rule: a superset of single bytes (digits, + @ A - _) and of pairs or triples
 * rare in prose (be(arer), ba(sic), ke(y|n) of key and token, xo(x), eyj, the ssw of password,
 * pwd, Sg. of SendGrid, E2 84 of the Kelvin sign, C5 BF of the long s). Pairs compare
 * case-folded bytes (b | 0x20), which maps only the letters' cases together and a few other
 * bytes onto others: a superset again. classify16 applies it to the 16 bytes at p (reading
 * p[0, 18)): `trig`, a bit per byte that starts a check; `run`, a bit per byte in [A-Za-z0-9/+]. */
#if defined(__SSE2__)

static inline void classify16(const uint8_t *p, uint32_t *trig, uint32_t *run) {
#define SET(c) _mm_set1_epi8((char)(c))
#define EQ(x, c) _mm_cmpeq_epi8(x, SET(c))
#define AND3(a, b, c) _mm_and_si128(_mm_and_si128(a, b), c)
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
    t = _mm_or_si128(t, _mm_or_si128(_mm_and_si128(EQ(l0, 'b'), _mm_or_si128(e1, EQ(l1, 'a'))),
                                     _mm_and_si128(EQ(l0, 'x'), EQ(l1, 'o'))));
    t = _mm_or_si128(t, _mm_and_si128(_mm_and_si128(EQ(l0, 'k'), e1), _mm_or_si128(EQ(l2, 'y'), EQ(l2, 'n'))));
    t = _mm_or_si128(t, _mm_or_si128(AND3(EQ(l0, 'e'), EQ(l1, 'y'), EQ(l2, 'j')),
                                     AND3(EQ(l0, 's'), EQ(l1, 's'), EQ(l2, 'w'))));
    t = _mm_or_si128(t, _mm_or_si128(AND3(EQ(l0, 'p'), EQ(l1, 'w'), EQ(l2, 'd')),
                                     AND3(EQ(v, 'S'), EQ(l1, 'g'), EQ(l2, '.'))));
    t = _mm_or_si128(t, _mm_or_si128(_mm_and_si128(EQ(v, 0xE2), EQ(l1, 0x84 | 0x20)),
                                     _mm_and_si128(EQ(v, 0xC5), EQ(l1, 0xBF))));
#undef AND3
#undef EQ
#undef SET
    *trig = (uint32_t)_mm_movemask_epi8(t);
    *run = (uint32_t)_mm_movemask_epi8(in_run);
}

#else

enum { C_TRIG = 1, C_RUN = 2, C_PAIR = 4 };

static uint8_t byte_class[256];

static void classes_init(void) {
    for (int c = 0; c < 256; c++) {
        int lower = c | 0x20, digit = c >= '0' && c <= '9';
        int run = digit || (lower >= 'a' && lower <= 'z') || c == '/' || c == '+';
        int trig = digit || c == '+' || c == '@' || c == 'A' || c == '-' || c == '_';
        int pair = lower == 'b' || lower == 'x' || lower == 'k' || lower == 'e' || lower == 's' || lower == 'p' ||
                   c == 0xE2 || c == 0xC5;
        byte_class[c] = (uint8_t)((trig ? C_TRIG : 0) | (run ? C_RUN : 0) | (pair ? C_PAIR : 0));
    }
}

/* The SSE2 code's pairs and triples, at p[0] (reading p[0, 3)). */
static inline int pair_at(const uint8_t *p) {
    uint8_t v = p[0], l1 = p[1] | 0x20, l2 = p[2] | 0x20;
    switch (v | 0x20) {
    case 'b':
        return l1 == 'e' || l1 == 'a';
    case 'x':
        return l1 == 'o';
    case 'k':
        return l1 == 'e' && (l2 == 'y' || l2 == 'n');
    case 'e':
        return l1 == 'y' && l2 == 'j';
    case 's':
        return (l1 == 's' && l2 == 'w') || (v == 'S' && l1 == 'g' && l2 == '.');
    case 'p':
        return l1 == 'w' && l2 == 'd';
    }
    return (v == 0xE2 && l1 == (0x84 | 0x20)) || (v == 0xC5 && l1 == 0xBF);
}

static inline void classify16(const uint8_t *p, uint32_t *trig, uint32_t *run) {
    uint32_t t = 0, r = 0;
    for (int k = 0; k < 16; k++) {
        uint8_t c = byte_class[p[k]];
        if ((c & C_TRIG) || ((c & C_PAIR) && pair_at(p + k)))
            t |= 1u << k;
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
