/* One SageMaker Data Capture line → one row of columns, with the msgspec batch path's rules. */
#ifndef CAPTURE_CAPTURE_H
#define CAPTURE_CAPTURE_H

#include "columns.h"
#include "json.h"

enum From { FROM_SYSTEM, FROM_HUMAN, FROM_GPT };
enum Format { FMT_OPENAI_CHAT, FMT_OPENAI_COMPLETION, FMT_TGI, FMT_JUMPSTART_CHAT };

/* What became of a line (J_NOMEM aside). */
enum { LINE_ROW = 1, LINE_SKIP = 2, LINE_DECLINED = 3 };

/* One conversation turn: its text is the concatenation of pieces[first, first + count). */
typedef struct {
    int from;
    size_t first, count;
} Turn;

/* The decoded line; Spans point into the line or into the arena. */
typedef struct {
    Span event_id, inference_id, inference_time, model;
    int format, raw;
    OptF64 temperature, top_p;
    OptI64 max_tokens;
    Buf turns;  /* Turn */
    Buf pieces; /* Span */
    Arena arena;
} Row;

/* The columns of a chunk's rows, as ROW_SCHEMA lays them out (line_no as chunk indices). */
typedef struct {
    Buf index;        /* int64 */
    Buf conv_offsets; /* int32, rows + 1 */
    StrCol from, value, event_id, inference_id, inference_time, model, format;
    Buf raw; /* bitmap */
    FixedCol temperature, top_p, max_tokens;
    int64_t rows, turns;
} Columns;

/* str.isspace() of one code point, as Python 3.11 decides it. */
int py_isspace(uint32_t cp);

/* "system", "human" or "gpt". */
const char *from_name(int from);
void row_reset(Row *row);
void row_free(Row *row);
/* LINE_ROW (row filled), LINE_SKIP (tabular traffic), LINE_DECLINED or J_NOMEM. */
int capture_line(const uint8_t *line, size_t n, Row *row);

int columns_init(Columns *c);
int columns_add(Columns *c, const Row *row, int64_t index);
void columns_free(Columns *c);

#endif
