/* One SageMaker Data Capture line → one row of columns, with the msgspec batch path's rules. */
#ifndef CAPTURE_CAPTURE_H
#define CAPTURE_CAPTURE_H

#include "columns.h"
#include "json.h"

/* Numbered as capture/rules.py orders SPEAKERS, FORMATS and ENCODINGS; their names come from there. */
enum From { FROM_SYSTEM, FROM_HUMAN, FROM_GPT, N_FROM };
enum Format { FMT_OPENAI_CHAT, FMT_OPENAI_COMPLETION, FMT_TGI, FMT_JUMPSTART_CHAT, N_FORMAT };
enum Kind { KIND_JSON, KIND_BASE64, KIND_CSV, N_KIND, KIND_UNKNOWN = N_KIND };

/* ---- the format rules -------------------------------------------------------------- */

/* The decoder holds no rule of its own: capture/rules.py is the one table, which
 * module.c's configure() copies into RULES (capture.native calls it on import). Until
 * then RULES.configured is 0 and the entry points refuse to decode. */
#define RULE_TEXT 64
#define RULE_ROLES 64
#define N_MAX_TOKENS_KEYS 3
#define N_PLAIN_ROLES 3

typedef struct {
    uint8_t s[RULE_TEXT];
    size_t len;
} RuleText;

typedef struct {
    RuleText name; /* lowercase ASCII */
    int from;
} RoleRule;

enum TimeField { T_YEAR, T_MONTH, T_DAY, T_HOUR, T_MINUTE, T_SECOND, N_TIME_FIELDS };

typedef struct {
    int configured;
    RuleText speakers[N_FROM], formats[N_FORMAT], encodings[N_KIND]; /* encodings: upper case */
    RoleRule roles[RULE_ROLES];
    size_t n_roles;
    RuleText csv_content_type, sse_content_type; /* lowercase ASCII */
    RuleText sse_data, sse_head, sse_sep, sse_tail;
    /* inferenceTime: the layout; each field's offset and width in it, the other bytes literal. */
    RuleText time_layout;
    size_t time_at[N_TIME_FIELDS], time_width[N_TIME_FIELDS];
    uint8_t time_digit[RULE_TEXT]; /* 1 where the layout has a field's digit */
    double temperature_lo, temperature_hi, top_p_lo, top_p_hi;
    RuleText max_tokens_keys[N_MAX_TOKENS_KEYS]; /* first present wins */
    RuleText plain_roles[N_PLAIN_ROLES];          /* chat roles kept as conversations alone, as sent */
} Rules;

extern Rules RULES;

/* What became of a line (J_NOMEM aside). */
enum { LINE_ROW = 1, LINE_SKIP = 2, LINE_DECLINED = 3 };

/* One conversation turn: its text is the concatenation of pieces[first, first + count). */
typedef struct {
    int from;
    size_t first, count;
} Turn;

/* One tool call of a stream, merged from its fragments as capture.formats._merge_calls does. */
#define MAX_STREAM_CALLS 16
typedef struct {
    int64_t index;
    Span id, type, name;     /* ptr NULL: not given (yet) */
    int keys[3], n_keys;     /* the call's keys in the order given: 0 id, 1 type, 2 function */
    int fn_keys[2], n_fn_keys; /* function's: 0 name, 1 arguments */
    Buf arguments;
} StreamCall;

/* The whole exchange, where the reference keeps it (capture.formats.Answer and the request's
 * messages, tools, tool_choice, chat_template_kwargs as sent). */
typedef struct {
    int has_messages, has_tools, has_tool_choice, has_kwargs, has_prompt_ids, has_output_ids;
    Buf messages, tools, tool_choice, kwargs; /* canonical JSON text */
    Buf prompt_ids, output_ids;               /* int32 */
    /* Scratch of the decoding. */
    Buf ids, reasoning, canon;                /* ids: int32; reasoning: Span pieces */
    int has_reasoning;
    StreamCall calls[MAX_STREAM_CALLS];
    int n_calls;
} Exchange;

/* The decoded line; Spans point into the line or into the arena. */
typedef struct {
    Span event_id, inference_id, inference_time, model, finish_reason;
    int format, raw;
    OptF64 temperature, top_p;
    OptI64 max_tokens;
    Buf turns;  /* Turn */
    Buf pieces; /* Span */
    Exchange ex;
    Arena arena;
} Row;

/* A row the reference keeps exactly (whole exchange or token ids): never a copy of a plain one. */
static inline int row_exact(const Row *row) {
    return row->ex.has_messages || row->ex.has_prompt_ids || row->ex.has_output_ids;
}

/* An Arrow list<int32> column. */
typedef struct {
    Buf offsets, values, validity;
    int64_t length, nulls;
} IdsCol;

/* The columns of a chunk's rows, as ROW_SCHEMA lays them out (line_no as chunk indices). */
typedef struct {
    Buf index;        /* int64 */
    Buf conv_offsets; /* int32, rows + 1 */
    StrCol from, value, event_id, inference_id, inference_time, model, format, finish_reason;
    StrCol messages, tools, tool_choice, chat_template_kwargs;
    IdsCol prompt_token_ids, output_token_ids;
    Buf raw; /* bitmap */
    FixedCol temperature, top_p, max_tokens;
    int64_t rows, turns;
} Columns;

/* SageMaker's inferenceTime in RULES' layout (every field in range, the day in its month) as
 * microseconds since the epoch; 0 for anything else, which Python then parses. */
int canonical_time(const uint8_t *p, size_t n, int64_t *us);

/* str.isspace() of one code point, as Python 3.11 decides it. */
int py_isspace(uint32_t cp);

/* The speaker's name (RULES.speakers). */
Span from_name(int from);
void row_reset(Row *row);
void row_free(Row *row);
/* LINE_ROW (row filled), LINE_SKIP (tabular traffic), LINE_DECLINED or J_NOMEM. */
int capture_line(const uint8_t *line, size_t n, Row *row);

int columns_init(Columns *c);
int columns_add(Columns *c, const Row *row, int64_t index);
void columns_free(Columns *c);

#endif
