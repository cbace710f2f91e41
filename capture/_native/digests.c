/* The digest set of digests.h. Digests are BLAKE2b output: their first 8 bytes are already
 * uniform, so they pick the slot directly. */
#include "digests.h"

#include <string.h>

static const uint8_t ZERO[16];

static size_t home(const uint8_t d[16], size_t slots) {
    uint64_t h;
    memcpy(&h, d, 8);
    return (size_t)(h & (uint64_t)(slots - 1));
}

/* The slot holding d, or else the empty slot where it would go; NULL if neither (a full table). */
static uint8_t *find(const uint8_t *table, size_t slots, const uint8_t d[16]) {
    uint8_t *slot0 = (uint8_t *)table + 16;
    size_t i = home(d, slots);
    for (size_t probes = 0; probes < slots; probes++, i = (i + 1) & (slots - 1)) {
        uint8_t *s = slot0 + 16 * i;
        if (memcmp(s, d, 16) == 0 || memcmp(s, ZERO, 16) == 0)
            return s;
    }
    return NULL;
}

int digests_add(uint8_t *table, size_t slots, const uint8_t d[16]) {
    if (memcmp(d, ZERO, 16) == 0) {
        if (table[0])
            return 0;
        table[0] = 1;
        return 1;
    }
    uint8_t *s = find(table, slots, d);
    if (s == NULL)
        return -1;
    if (memcmp(s, d, 16) == 0)
        return 0;
    memcpy(s, d, 16);
    return 1;
}

int digests_contains(const uint8_t *table, size_t slots, const uint8_t d[16]) {
    if (memcmp(d, ZERO, 16) == 0)
        return table[0] != 0;
    const uint8_t *s = find(table, slots, d);
    return s != NULL && memcmp(s, d, 16) == 0;
}

void digests_rehash(const uint8_t *old_table, size_t old_slots, uint8_t *new_table, size_t new_slots) {
    new_table[0] = old_table[0];
    for (size_t i = 0; i < old_slots; i++) {
        const uint8_t *s = old_table + 16 + 16 * i;
        if (memcmp(s, ZERO, 16) != 0)
            digests_add(new_table, new_slots, s);
    }
}

static int nibble(uint8_t c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

int digest_from_hex(const uint8_t *hex, size_t n, uint8_t out[16]) {
    if (n != 32)
        return 0;
    for (int i = 0; i < 16; i++) {
        int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return 0;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return 1;
}
