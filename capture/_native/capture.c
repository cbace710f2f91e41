/* Capture lines → rows, with exactly the rules of capture.batchpath.decode_chunk_msgspec for
 * every line accepted; anything else is declined. The rules' values (roles, content types,
 * the SSE forms, the time layout, sampling ranges) are RULES, given by capture/rules.py. */
#define _GNU_SOURCE /* memmem */
#include <string.h>

#include "capture.h"

Rules RULES;

static Span rule_span(const RuleText *t) {
    Span s = {t->s, t->len};
    return s;
}

Span from_name(int from) { return rule_span(&RULES.speakers[from]); }

#define KEY(k, lit) ((k).len == sizeof(lit) - 1 && memcmp((k).ptr, lit, sizeof(lit) - 1) == 0)
/* A field of interest seen twice: msgspec keeps the last, the reference parser too, but
 * rather than rely on that the line is declined. */
#define ONCE(seen, bit)                                                                                               \
    do {                                                                                                              \
        if ((seen) & (bit))                                                                                           \
            return J_DECLINE;                                                                                         \
        (seen) |= (bit);                                                                                              \
    } while (0)
#define TRY(expr)                                                                                                     \
    do {                                                                                                              \
        int r_ = (expr);                                                                                              \
        if (r_ != J_OK)                                                                                               \
            return r_;                                                                                                \
    } while (0)

/* ---- Python's str semantics on UTF-8 ---------------------------------------------- */

/* str.isspace() of one code point (Python 3.11: Unicode White_Space plus \x1c-\x1f). */
int py_isspace(uint32_t cp) {
    switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x1C: case 0x1D: case 0x1E: case 0x1F: case 0x20:
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
        return 1;
    default:
        return cp >= 0x2000 && cp <= 0x200A;
    }
}

/* str.lstrip() of valid UTF-8. */
static Span py_lstrip(Span t) {
    while (t.len) {
        int k;
        uint32_t cp = utf8_decode(t.ptr, &k);
        if ((size_t)k > t.len || !py_isspace(cp))
            break;
        t.ptr += k;
        t.len -= (size_t)k;
    }
    return t;
}

/* str.isspace() of a text given in pieces of valid UTF-8 (False when empty). */
static int pieces_isspace(const Span *pieces, size_t n) {
    int any = 0;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *p = pieces[i].ptr, *end = p + pieces[i].len;
        while (p < end) {
            int k;
            if (!py_isspace(utf8_decode(p, &k)))
                return 0;
            p += k;
            any = 1;
        }
    }
    return any;
}

static int is_ascii(Span t) {
    for (size_t i = 0; i < t.len; i++)
        if (t.ptr[i] >= 0x80)
            return 0;
    return 1;
}

static uint8_t ascii_lower(uint8_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

static const uint8_t *find(Span hay, const char *needle) {
    return memmem(hay.ptr, hay.len, needle, strlen(needle));
}

/* capture.batchpath.escapes_ascii: a \u escape of a printable ASCII character (which could
 * spell a key that the substring dispatch would not see). */
static int escapes_ascii(Span t) {
    const uint8_t *p = t.ptr, *end = t.ptr + t.len;
    while ((p = memmem(p, (size_t)(end - p), "\\u00", 4)) != NULL) {
        if (end - p >= 6 && p[4] >= '2' && p[4] <= '7' &&
            ((p[5] >= '0' && p[5] <= '9') || (p[5] >= 'a' && p[5] <= 'f') || (p[5] >= 'A' && p[5] <= 'F')))
            return 1;
        p++;
    }
    return 0;
}

/* ---- row building ----------------------------------------------------------------- */

static int push_piece(Row *row, Span s) { return buf_put(&row->pieces, &s, sizeof s); }

static size_t n_pieces(const Row *row) { return row->pieces.len / sizeof(Span); }

static int push_turn(Row *row, int from, size_t first) {
    Turn t = {from, first, n_pieces(row) - first};
    return buf_put(&row->turns, &t, sizeof t);
}

/* rules.ROLE_MAP[role.lower()] as a From, or -1 (non-ASCII roles never map: declined, since
 * str.lower() of a non-ASCII character may be ASCII). */
static int role_from(Span role) {
    uint8_t lower[RULE_TEXT];
    if (role.len >= sizeof lower)
        return -1;
    for (size_t i = 0; i < role.len; i++) {
        if (role.ptr[i] >= 0x80)
            return -1;
        lower[i] = ascii_lower(role.ptr[i]);
    }
    for (size_t i = 0; i < RULES.n_roles; i++)
        if (RULES.roles[i].name.len == role.len && memcmp(RULES.roles[i].name.s, lower, role.len) == 0)
            return RULES.roles[i].from;
    return -1;
}

/* A field the rows keep only in the reference's structured columns (tools, reasoning, tool
 * calls, token ids): null is as good as absent, anything else leaves the line to the reference. */
static int absent(Scan *s) { return json_null(s) ? J_OK : J_DECLINE; }

/* As absent(), an empty array too (vLLM writes "tool_calls": [] for an answer without calls). */
static int absent_or_empty(Scan *s) {
    if (json_null(s))
        return J_OK;
    if (json_peek(s) != '[')
        return J_DECLINE;
    Scan t = *s;
    t.p++;
    json_ws(&t);
    if (json_peek(&t) != ']')
        return J_DECLINE;
    s->p = t.p + 1;
    return J_OK;
}

/* A key equal to a rule's text. */
static int key_is(Span key, const RuleText *t) { return key.len == t->len && memcmp(key.ptr, t->s, t->len) == 0; }

/* A chat role a template renders as conversations' from/value says (RULES.plain_roles, as sent). */
static int plain_role(Span role) {
    for (int i = 0; i < N_PLAIN_ROLES; i++)
        if (key_is(role, &RULES.plain_roles[i]))
            return 1;
    return 0;
}

/* ---- request payloads ------------------------------------------------------------- */

enum ReqKind { REQ_CHAT, REQ_COMPLETION, REQ_TGI, REQ_DIALOGS, REQ_DIALOG };

/* batchpath._Params; max_tokens[i] is the value of RULES.max_tokens_keys[i]. */
typedef struct {
    OptF64 temperature, top_p;
    OptI64 max_tokens[N_MAX_TOKENS_KEYS];
} Params;

typedef struct {
    Params params;
    Span model, text; /* text: the completion prompt or TGI inputs */
    int human;        /* a message of the user's among the turns */
} Request;

/* Seen-bits of request members; B_MAX_TOKENS << i for RULES.max_tokens_keys[i]. */
enum { B_TEMPERATURE = 1, B_TOP_P = 2, B_MODEL = 4, B_MAIN = 8, B_PARAMETERS = 16, B_MAX_TOKENS = 32 };

/* One of _Params' fields if `key` names one (*hit says whether it did). */
static int params_member(Scan *s, Span key, Params *p, unsigned *seen, int *hit) {
    *hit = 1;
    if (KEY(key, "temperature")) {
        ONCE(*seen, B_TEMPERATURE);
        return json_opt_double(s, &p->temperature);
    }
    if (KEY(key, "top_p")) {
        ONCE(*seen, B_TOP_P);
        return json_opt_double(s, &p->top_p);
    }
    for (int i = 0; i < N_MAX_TOKENS_KEYS; i++)
        if (key_is(key, &RULES.max_tokens_keys[i])) {
            ONCE(*seen, (unsigned)B_MAX_TOKENS << i);
            return json_opt_int64(s, &p->max_tokens[i]);
        }
    *hit = 0;
    return J_OK;
}

/* `parameters`: _Params or null. */
static int parse_parameters(Scan *s, Params *p, int depth) {
    if (json_null(s))
        return J_OK;
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r, hit;
    Span key;
    while ((r = json_member(s, &n, &key)) == 1) {
        TRY(params_member(s, key, p, &seen, &hit));
        if (!hit)
            TRY(json_skip(s, depth + 1));
    }
    return r;
}

/* batchpath._Msg: role and content, both strings (strict, batchpath._ChatMsg: no other key). */
static int parse_message(Scan *s, Arena *a, int depth, int strict, Span *role, Span *content) {
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r;
    Span key;
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "role")) {
            ONCE(seen, 1);
            TRY(json_str(s, a, role));
        } else if (KEY(key, "content")) {
            ONCE(seen, 2);
            TRY(json_str(s, a, content));
        } else if (strict) {
            return J_DECLINE; /* tool_calls, tool_call_id, name, reasoning: the reference keeps them */
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    if (r != J_OK)
        return r;
    return seen == 3 ? J_OK : J_DECLINE;
}

/* list[_Msg] → turns (batchpath._turns: known roles, non-empty content). */
static int parse_messages(Scan *s, Row *row, int depth, int strict, int *human) {
    if (json_peek(s) != '[')
        return J_DECLINE;
    s->p++;
    int n = 0, r;
    while ((r = json_element(s, &n)) == 1) {
        Span role, content;
        TRY(parse_message(s, &row->arena, depth + 1, strict, &role, &content));
        int from = role_from(role);
        if (from < 0 || content.len == 0 || (strict && !plain_role(role)))
            return J_DECLINE;
        *human |= from == FROM_HUMAN;
        size_t first = n_pieces(row);
        TRY(push_piece(row, content));
        TRY(push_turn(row, from, first));
    }
    return r;
}

/* `inputs` of the TGI/JumpStart requests. */
static int parse_inputs(Scan *s, int kind, Row *row, Request *req, int depth) {
    if (kind == REQ_TGI)
        return json_str(s, &row->arena, &req->text);
    if (kind == REQ_DIALOG)
        return parse_messages(s, row, depth, 0, &req->human);
    /* list[list[_Msg]]: exactly one dialog, or the batch is left to the reference. */
    if (json_peek(s) != '[')
        return J_DECLINE;
    s->p++;
    int n = 0, r;
    while ((r = json_element(s, &n)) == 1) {
        if (n > 1)
            return J_DECLINE;
        TRY(parse_messages(s, row, depth + 1, 0, &req->human));
    }
    if (r != J_OK)
        return r;
    return n == 1 ? J_OK : J_DECLINE;
}

/* The request payload as the struct of its kind (_ChatReq, _CompletionReq, _TgiReq, ...). */
static int parse_request(Span text, int kind, Row *row, Request *req) {
    Scan s = {text.ptr, text.ptr + text.len};
    json_ws(&s);
    if (json_peek(&s) != '{')
        return J_DECLINE;
    s.p++;
    unsigned seen = 0;
    int n = 0, r, hit = 0;
    Span key;
    int openai = kind == REQ_CHAT || kind == REQ_COMPLETION;
    while ((r = json_member(&s, &n, &key)) == 1) {
        if (openai) {
            TRY(params_member(&s, key, &req->params, &seen, &hit));
            if (hit)
                continue;
        }
        if (KEY(key, "model")) {
            ONCE(seen, B_MODEL);
            TRY(json_opt_str(&s, &row->arena, &req->model));
        } else if (kind == REQ_CHAT && KEY(key, "messages")) {
            ONCE(seen, B_MAIN);
            TRY(parse_messages(&s, row, 1, 1, &req->human));
        } else if (kind == REQ_CHAT && (KEY(key, "tools") || KEY(key, "tool_choice") ||
                                        KEY(key, "chat_template_kwargs"))) {
            TRY(absent(&s));
        } else if (kind == REQ_COMPLETION && KEY(key, "prompt")) {
            ONCE(seen, B_MAIN);
            TRY(json_str(&s, &row->arena, &req->text));
        } else if (!openai && KEY(key, "inputs")) {
            ONCE(seen, B_MAIN);
            TRY(parse_inputs(&s, kind, row, req, 1));
        } else if (!openai && KEY(key, "parameters")) {
            ONCE(seen, B_PARAMETERS);
            TRY(parse_parameters(&s, &req->params, 1));
        } else {
            TRY(json_skip(&s, 1));
        }
    }
    if (r != J_OK)
        return r;
    json_ws(&s);
    if (s.p != s.end || !(seen & B_MAIN))
        return J_DECLINE;
    return J_OK;
}

/* Which request struct the text's `"inputs"` asks for (the fast path's look past the key). */
static int inputs_kind(Span req, const uint8_t *after_key) {
    Span rest = {after_key, (size_t)(req.ptr + req.len - after_key)};
    rest = py_lstrip(rest);
    while (rest.len && rest.ptr[0] == ':') {
        rest.ptr++;
        rest.len--;
    }
    rest = py_lstrip(rest);
    if (rest.len >= 1 && rest.ptr[0] == '"')
        return REQ_TGI;
    if (rest.len >= 2 && rest.ptr[0] == '[' && rest.ptr[1] == '[')
        return REQ_DIALOGS;
    return REQ_DIALOG;
}

/* ---- response payloads ------------------------------------------------------------ */

/* rules.looks_sse; a non-ASCII content type (whose str.lower() this does not model) declines. */
static int looks_sse(Span text, Span ct, int *sse) {
    const RuleText *want = &RULES.sse_content_type;
    if (ct.ptr != NULL && ct.len) {
        if (!is_ascii(ct))
            return J_DECLINE;
        for (size_t i = 0; i + want->len <= ct.len; i++) {
            size_t j = 0;
            while (j < want->len && ascii_lower(ct.ptr[i + j]) == want->s[j])
                j++;
            if (j == want->len) {
                *sse = 1;
                return J_OK;
            }
        }
    }
    Span t = py_lstrip(text);
    const RuleText *data = &RULES.sse_data;
    *sse = t.len >= data->len && memcmp(t.ptr, data->s, data->len) == 0;
    return J_OK;
}

/* Skips trailing whitespace and requires the end of the document. */
static int json_end(Scan *s) {
    json_ws(s);
    return s->p == s->end ? J_OK : J_DECLINE;
}

/* batchpath._Choice (message: _RespMsg | None, text: str | None), remembered for choice 0. */
typedef struct {
    Span content, text, finish_reason; /* content.ptr: a message was given */
} Choice;

static int parse_choice(Scan *s, Arena *a, int depth, Choice *c) {
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r;
    Span key;
    c->content.ptr = c->text.ptr = c->finish_reason.ptr = NULL;
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "message")) {
            ONCE(seen, 1);
            if (json_null(s))
                continue;
            /* _RespMsg: content, a string, required */
            if (json_peek(s) != '{')
                return J_DECLINE;
            s->p++;
            unsigned mseen = 0;
            int mn = 0, mr;
            Span mkey;
            while ((mr = json_member(s, &mn, &mkey)) == 1) {
                if (KEY(mkey, "content")) {
                    ONCE(mseen, 1);
                    TRY(json_str(s, a, &c->content));
                } else if (KEY(mkey, "reasoning") || KEY(mkey, "reasoning_content")) {
                    TRY(absent(s));
                } else if (KEY(mkey, "tool_calls")) {
                    TRY(absent_or_empty(s));
                } else {
                    TRY(json_skip(s, depth + 2));
                }
            }
            if (mr != J_OK)
                return mr;
            if (!mseen)
                return J_DECLINE;
        } else if (KEY(key, "text")) {
            ONCE(seen, 2);
            TRY(json_opt_str(s, a, &c->text));
        } else if (KEY(key, "finish_reason")) {
            ONCE(seen, 4);
            TRY(json_opt_str(s, a, &c->finish_reason));
        } else if (KEY(key, "token_ids") || KEY(key, "prompt_token_ids")) {
            TRY(absent(s));
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    return r;
}

/* batchpath._Resp → the first choice's text (chat: message.content; completion: text). */
static int openai_response(Span text, int chat, Row *row, Span *model) {
    Scan s = {text.ptr, text.ptr + text.len};
    json_ws(&s);
    if (json_peek(&s) != '{')
        return J_DECLINE;
    s.p++;
    unsigned seen = 0;
    int n = 0, r, n_choices = 0;
    Span key, object = {NULL, 0};
    Choice first = {{NULL, 0}, {NULL, 0}, {NULL, 0}};
    while ((r = json_member(&s, &n, &key)) == 1) {
        if (KEY(key, "choices")) {
            ONCE(seen, 1);
            if (json_peek(&s) != '[')
                return J_DECLINE;
            s.p++;
            int rc;
            while ((rc = json_element(&s, &n_choices)) == 1) {
                Choice c;
                TRY(parse_choice(&s, &row->arena, 2, &c));
                if (n_choices == 1)
                    first = c;
            }
            if (rc != J_OK)
                return rc;
        } else if (KEY(key, "model")) {
            ONCE(seen, 2);
            TRY(json_opt_str(&s, &row->arena, model));
        } else if (KEY(key, "object")) {
            ONCE(seen, 4);
            TRY(json_opt_str(&s, &row->arena, &object));
        } else if (KEY(key, "prompt_token_ids")) {
            TRY(absent(&s));
        } else if (KEY(key, "error")) {
            return J_DECLINE; /* error responses: the reference counts the skip */
        } else {
            TRY(json_skip(&s, 1));
        }
    }
    if (r != J_OK)
        return r;
    TRY(json_end(&s));
    if (!(seen & 1) || n_choices == 0)
        return J_DECLINE;
    if (object.ptr != NULL && KEY(object, "error"))
        return J_DECLINE;
    Span answer = chat ? first.content : first.text;
    if (answer.ptr == NULL)
        return J_DECLINE;
    row->finish_reason = first.finish_reason;
    return push_piece(row, answer);
}

/* batchpath._StreamChoice: its text goes to the answer if it is choice 0. */
static int parse_stream_choice(Scan *s, Row *row, int depth) {
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r, has_delta = 0;
    int64_t index = 0;
    Span key, content = {NULL, 0}, text = {NULL, 0}, finish = {NULL, 0};
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "index")) {
            ONCE(seen, 1);
            TRY(json_int64(s, &index));
        } else if (KEY(key, "delta")) {
            ONCE(seen, 2);
            if (json_null(s))
                continue;
            /* _Delta: content, str | None */
            if (json_peek(s) != '{')
                return J_DECLINE;
            s->p++;
            has_delta = 1;
            unsigned dseen = 0;
            int dn = 0, dr;
            Span dkey;
            while ((dr = json_member(s, &dn, &dkey)) == 1) {
                if (KEY(dkey, "content")) {
                    ONCE(dseen, 1);
                    TRY(json_opt_str(s, &row->arena, &content));
                } else if (KEY(dkey, "reasoning") || KEY(dkey, "reasoning_content") || KEY(dkey, "tool_calls")) {
                    TRY(absent(s));
                } else {
                    TRY(json_skip(s, depth + 2));
                }
            }
            if (dr != J_OK)
                return dr;
        } else if (KEY(key, "text")) {
            ONCE(seen, 4);
            TRY(json_opt_str(s, &row->arena, &text));
        } else if (KEY(key, "finish_reason")) {
            ONCE(seen, 8);
            TRY(json_opt_str(s, &row->arena, &finish));
        } else if (KEY(key, "token_ids") || KEY(key, "prompt_token_ids")) {
            TRY(absent(s));
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    if (r != J_OK || index != 0)
        return r; /* n > 1 sampling: only choice 0 is the conversation */
    if (finish.ptr != NULL)
        row->finish_reason = finish; /* the last one given */
    if (has_delta)
        return content.ptr != NULL ? push_piece(row, content) : J_OK;
    return text.ptr != NULL ? push_piece(row, text) : J_OK;
}

/* batchpath._Chunk; error events and TGI token streams are declined. */
static int parse_chunk(Scan *s, Row *row, int depth, Span *model) {
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r;
    Span key, chunk_model = {NULL, 0};
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "choices")) {
            ONCE(seen, 1);
            if (json_null(s))
                continue;
            if (json_peek(s) != '[')
                return J_DECLINE;
            s->p++;
            int cn = 0, cr;
            while ((cr = json_element(s, &cn)) == 1)
                TRY(parse_stream_choice(s, row, depth + 2));
            if (cr != J_OK)
                return cr;
        } else if (KEY(key, "model")) {
            ONCE(seen, 2);
            TRY(json_opt_str(s, &row->arena, &chunk_model));
        } else if (KEY(key, "prompt_token_ids")) {
            TRY(absent(s));
        } else if (KEY(key, "error") || KEY(key, "token") || KEY(key, "generated_text")) {
            return J_DECLINE;
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    if (r == J_OK && chunk_model.ptr != NULL)
        *model = chunk_model; /* the last chunk that names a model wins */
    return r;
}

#define LIT_LEN(s) (sizeof(s) - 1)

/* batchpath.canonical_sse: the JSON array of a stream in rules' canonical form (RULES.sse_head,
 * _sep, _tail), or decline (the msgspec path's general SSE parser is not reproduced here). */
static int canonical_sse(Span text, Arena *a, Span *arr) {
    const RuleText *head = &RULES.sse_head, *sep = &RULES.sse_sep, *tail = &RULES.sse_tail;
    if (text.len < head->len + tail->len || memcmp(text.ptr, head->s, head->len) != 0 ||
        memcmp(text.ptr + text.len - tail->len, tail->s, tail->len) != 0)
        return J_DECLINE;
    const uint8_t *p = text.ptr + head->len, *end = text.ptr + text.len - tail->len;
    uint8_t *out = arena_alloc(a, (size_t)(end - p) + 2);
    if (out == NULL)
        return J_NOMEM;
    arr->ptr = out;
    *out++ = '[';
    /* str.replace(sep, ","), left to right (configure checked that sep starts with a line break);
     * a line break that is not part of a separator would be left in the array, where the msgspec
     * path gives up on this form. */
    while (p < end) {
        const uint8_t *nl = memchr(p, '\n', (size_t)(end - p));
        size_t run = (size_t)((nl ? nl : end) - p);
        memcpy(out, p, run);
        out += run;
        p += run;
        if (nl == NULL)
            break;
        if ((size_t)(end - p) < sep->len || memcmp(p, sep->s, sep->len) != 0)
            return J_DECLINE;
        *out++ = ',';
        p += sep->len;
    }
    *out++ = ']';
    arr->len = (size_t)(out - arr->ptr);
    /* "\r", U+0085, U+2028 and U+2029 are line breaks to the general parser too. */
    if (memchr(arr->ptr, '\r', arr->len) != NULL)
        return J_DECLINE;
    for (const uint8_t *q = arr->ptr; (q = memchr(q, 0xC2, (size_t)(out - q))) != NULL; q++)
        if (q + 1 < out && q[1] == 0x85)
            return J_DECLINE;
    for (const uint8_t *q = arr->ptr; (q = memchr(q, 0xE2, (size_t)(out - q))) != NULL; q++)
        if (q + 2 < out && q[1] == 0x80 && (q[2] == 0xA8 || q[2] == 0xA9))
            return J_DECLINE;
    return J_OK;
}

/* batchpath._stream over the canonical form: the joined choice-0 texts, and the model. */
static int stream_response(Span text, Row *row, Span *model) {
    Span arr;
    TRY(canonical_sse(text, &row->arena, &arr));
    Scan s = {arr.ptr, arr.ptr + arr.len};
    s.p++; /* '[' */
    int n = 0, r;
    while ((r = json_element(&s, &n)) == 1)
        TRY(parse_chunk(&s, row, 1, model));
    if (r != J_OK)
        return r;
    return json_end(&s);
}

/* batchpath._Gen, remembered for the first item. */
typedef struct {
    int has_error;
    Span generated_text, generation; /* ptr == NULL: absent */
} Gen;

static int parse_gen(Scan *s, Arena *a, int depth, Gen *g) {
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r;
    Span key;
    memset(g, 0, sizeof *g);
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "generated_text")) {
            ONCE(seen, 1);
            TRY(json_str(s, a, &g->generated_text));
        } else if (KEY(key, "generation")) {
            ONCE(seen, 2);
            if (json_peek(s) == '"') {
                TRY(json_string(s, a, &g->generation));
                continue;
            }
            /* _GenMsg: content, a string, required */
            if (json_peek(s) != '{')
                return J_DECLINE;
            s->p++;
            unsigned mseen = 0;
            int mn = 0, mr;
            Span mkey;
            while ((mr = json_member(s, &mn, &mkey)) == 1) {
                if (KEY(mkey, "content")) {
                    ONCE(mseen, 1);
                    TRY(json_str(s, a, &g->generation));
                } else {
                    TRY(json_skip(s, depth + 2));
                }
            }
            if (mr != J_OK)
                return mr;
            if (!mseen)
                return J_DECLINE;
        } else if (KEY(key, "error")) {
            ONCE(seen, 4);
            g->has_error = 1;
            TRY(json_skip(s, depth + 1));
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    return r;
}

/* batchpath._tgi_answer: the generated text of a TGI/LMI/JumpStart response. */
static int tgi_response(Span text, Arena *a, Span *answer) {
    Scan s = {text.ptr, text.ptr + text.len};
    json_ws(&s);
    Gen first;
    if (json_peek(&s) == '[') {
        s.p++;
        int n = 0, r;
        while ((r = json_element(&s, &n)) == 1) {
            Gen g;
            TRY(parse_gen(&s, a, 1, &g));
            if (n == 1)
                first = g;
        }
        if (r != J_OK)
            return r;
        if (n == 0)
            return J_DECLINE;
    } else {
        TRY(parse_gen(&s, a, 0, &first));
    }
    TRY(json_end(&s));
    if (first.has_error)
        return J_DECLINE;
    *answer = first.generated_text.ptr != NULL ? first.generated_text : first.generation;
    return answer->ptr != NULL ? J_OK : J_DECLINE;
}

/* ---- one exchange ----------------------------------------------------------------- */

/* batchpath.exchange: the request/response pair → the row's turns and fields. */
static int decode_exchange(Span req, Span resp, Span resp_ct, Row *row) {
    Span head = py_lstrip(req);
    if (head.len == 0 || head.ptr[0] != '{' || escapes_ascii(req))
        return J_DECLINE;
    int kind;
    const uint8_t *inputs;
    if (find(req, "\"messages\""))
        kind = REQ_CHAT;
    else if (find(req, "\"prompt\""))
        kind = REQ_COMPLETION;
    else if ((inputs = find(req, "\"inputs\"")) != NULL)
        kind = inputs_kind(req, inputs + LIT_LEN("\"inputs\""));
    else
        return J_DECLINE;

    Request rq;
    memset(&rq, 0, sizeof rq);
    TRY(parse_request(req, kind, row, &rq));
    if (kind == REQ_COMPLETION || kind == REQ_TGI) { /* the raw prompt is the user's turn */
        size_t first = n_pieces(row);
        TRY(push_piece(row, rq.text));
        TRY(push_turn(row, FROM_HUMAN, first));
        rq.human = 1;
    }
    int sse;
    TRY(looks_sse(resp, resp_ct, &sse));
    size_t answer_first = n_pieces(row);
    Span resp_model = {NULL, 0};
    if (kind == REQ_CHAT || kind == REQ_COMPLETION) {
        if (sse)
            TRY(stream_response(resp, row, &resp_model));
        else
            TRY(openai_response(resp, kind == REQ_CHAT, row, &resp_model));
        row->model = rq.model.ptr != NULL ? rq.model : resp_model;
        row->format = kind == REQ_CHAT ? FMT_OPENAI_CHAT : FMT_OPENAI_COMPLETION;
        row->raw = kind == REQ_COMPLETION;
    } else {
        if (sse)
            return J_DECLINE;
        Span answer;
        TRY(tgi_response(resp, &row->arena, &answer));
        /* return_full_text=true echoes the prompt: the continuation is the answer. */
        if (kind == REQ_TGI && rq.text.len && answer.len >= rq.text.len &&
            memcmp(answer.ptr, rq.text.ptr, rq.text.len) == 0) {
            answer.ptr += rq.text.len;
            answer.len -= rq.text.len;
        }
        TRY(push_piece(row, answer));
        row->model = rq.model;
        row->format = kind == REQ_TGI ? FMT_TGI : FMT_JUMPSTART_CHAT;
        row->raw = kind == REQ_TGI;
    }
    const Span *pieces = (const Span *)row->pieces.data + answer_first;
    size_t count = n_pieces(row) - answer_first, total = 0;
    for (size_t i = 0; i < count; i++)
        total += pieces[i].len;
    if (total == 0 || pieces_isspace(pieces, count) || !rq.human)
        return J_DECLINE; /* empty answers and dialogs without a user turn: the reference decides */
    TRY(push_turn(row, FROM_GPT, answer_first));

    /* Out of rules.SAMPLING_RANGES (json_opt_double already declined NaN and infinities):
     * the reference quarantines these. The negated compares keep NaN out too. */
    const OptF64 *t = &rq.params.temperature, *p = &rq.params.top_p;
    if ((t->has && !(t->v >= RULES.temperature_lo && t->v <= RULES.temperature_hi)) ||
        (p->has && !(p->v >= RULES.top_p_lo && p->v <= RULES.top_p_hi)))
        return J_DECLINE;
    row->temperature = *t;
    row->top_p = *p;
    row->max_tokens.has = 0;
    for (int i = 0; i < N_MAX_TOKENS_KEYS; i++)
        if (rq.params.max_tokens[i].has) {
            row->max_tokens = rq.params.max_tokens[i];
            break;
        }
    return J_OK;
}

/* ---- the capture line ------------------------------------------------------------- */

/* batchpath._Side */
typedef struct {
    int present;
    Span data, encoding, content_type;
} Side;

static int parse_side(Scan *s, Arena *a, int depth, Side *side) {
    memset(side, 0, sizeof *side);
    if (json_null(s))
        return J_OK;
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r;
    Span key;
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "data")) {
            ONCE(seen, 1);
            TRY(json_str(s, a, &side->data));
        } else if (KEY(key, "encoding")) {
            ONCE(seen, 2);
            TRY(json_opt_str(s, a, &side->encoding));
        } else if (KEY(key, "observedContentType")) {
            ONCE(seen, 4);
            TRY(json_opt_str(s, a, &side->content_type));
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    if (r != J_OK)
        return r;
    if (!(seen & 1))
        return J_DECLINE; /* data is required */
    side->present = 1;
    return J_OK;
}

static int parse_capture_data(Scan *s, Arena *a, int depth, Side *in, Side *out) {
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r;
    Span key;
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "endpointInput")) {
            ONCE(seen, 1);
            TRY(parse_side(s, a, depth + 1, in));
            if (!in->present)
                return J_DECLINE; /* required, not nullable */
        } else if (KEY(key, "endpointOutput")) {
            ONCE(seen, 2);
            TRY(parse_side(s, a, depth + 1, out));
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    if (r != J_OK)
        return r;
    return (seen & 1) ? J_OK : J_DECLINE;
}

static int parse_metadata(Scan *s, Arena *a, int depth, Row *row) {
    if (json_null(s))
        return J_OK;
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r;
    Span key;
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "eventId")) {
            ONCE(seen, 1);
            TRY(json_opt_str(s, a, &row->event_id));
        } else if (KEY(key, "inferenceId")) {
            ONCE(seen, 2);
            TRY(json_opt_str(s, a, &row->inference_id));
        } else if (KEY(key, "inferenceTime")) {
            ONCE(seen, 4);
            TRY(json_opt_str(s, a, &row->inference_time));
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    return r;
}

/* batchpath._Line */
static int parse_line(Scan *s, Arena *a, Side *in, Side *out, Row *row) {
    json_ws(s);
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r;
    Span key;
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "captureData")) {
            ONCE(seen, 1);
            TRY(parse_capture_data(s, a, 1, in, out));
        } else if (KEY(key, "eventMetadata")) {
            ONCE(seen, 2);
            TRY(parse_metadata(s, a, 1, row));
        } else {
            TRY(json_skip(s, 1));
        }
    }
    if (r != J_OK)
        return r;
    TRY(json_end(s));
    return (seen & 1) ? J_OK : J_DECLINE;
}

/* rules.encoding_of: (encoding or JSON).upper(); non-ASCII names are not modelled. */
static int side_kind(Span enc) {
    if (enc.ptr == NULL || enc.len == 0)
        return KIND_JSON;
    uint8_t upper[RULE_TEXT];
    if (enc.len >= sizeof upper)
        return KIND_UNKNOWN;
    for (size_t i = 0; i < enc.len; i++) {
        uint8_t c = enc.ptr[i];
        if (c >= 0x80)
            return KIND_UNKNOWN;
        upper[i] = c >= 'a' && c <= 'z' ? c - 32 : c;
    }
    for (int k = 0; k < N_KIND; k++)
        if (RULES.encodings[k].len == enc.len && memcmp(RULES.encodings[k].s, upper, enc.len) == 0)
            return k;
    return KIND_UNKNOWN;
}

/* Base64 digit values; 0xFF marks everything else ('=' included). */
static uint8_t BASE64_VALUE[256];

static void base64_table_init(void) {
    static const char digits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    memset(BASE64_VALUE, 0xFF, sizeof BASE64_VALUE);
    for (int i = 0; i < 64; i++)
        BASE64_VALUE[(uint8_t)digits[i]] = (uint8_t)i;
}

/* base64.b64decode(data, validate=True): whole quads, '=' only as the last one or two
 * characters; bits beyond the last byte are ignored, as binascii does. */
static int base64_decode(Span in, Arena *a, Span *out) {
    if (in.len % 4)
        return J_DECLINE;
    size_t pad = 0;
    if (in.len && in.ptr[in.len - 1] == '=')
        pad = (in.len >= 2 && in.ptr[in.len - 2] == '=') ? 2 : 1;
    uint8_t *dst = arena_alloc(a, in.len / 4 * 3 + 1);
    if (dst == NULL)
        return J_NOMEM;
    const uint8_t *p = in.ptr, *full_end = in.ptr + (pad ? in.len - 4 : in.len);
    uint8_t *o = dst;
    for (; p < full_end; p += 4, o += 3) {
        uint32_t a0 = BASE64_VALUE[p[0]], a1 = BASE64_VALUE[p[1]], a2 = BASE64_VALUE[p[2]], a3 = BASE64_VALUE[p[3]];
        if ((a0 | a1 | a2 | a3) & 0x80)
            return J_DECLINE;
        uint32_t v = (a0 << 18) | (a1 << 12) | (a2 << 6) | a3;
        o[0] = (uint8_t)(v >> 16);
        o[1] = (uint8_t)(v >> 8);
        o[2] = (uint8_t)v;
    }
    if (pad) { /* the last quad: "xx==" is one byte, "xxx=" two */
        uint32_t a0 = BASE64_VALUE[p[0]], a1 = BASE64_VALUE[p[1]], a2 = pad == 1 ? BASE64_VALUE[p[2]] : 0;
        if ((a0 | a1 | a2) & 0x80)
            return J_DECLINE;
        uint32_t v = (a0 << 18) | (a1 << 12) | (a2 << 6);
        *o++ = (uint8_t)(v >> 16);
        if (pad == 1)
            *o++ = (uint8_t)(v >> 8);
    }
    out->ptr = dst;
    out->len = (size_t)(o - dst);
    return J_OK;
}

/* batchpath._text: a payload's text, or decline where the reference would quarantine. */
static int side_text(const Side *side, int kind, Arena *a, Span *text) {
    if (kind == KIND_JSON || kind == KIND_CSV) {
        *text = side->data; /* NUL-free and valid UTF-8: json_string saw to both */
        return J_OK;
    }
    if (kind != KIND_BASE64)
        return J_DECLINE;
    TRY(base64_decode(side->data, a, text));
    if (!utf8_valid(text->ptr, text->len) || memchr(text->ptr, 0, text->len) != NULL)
        return J_DECLINE;
    if (text->len == 0)
        text->ptr = side->data.ptr; /* empty, not null */
    return J_OK;
}

static int ascii_isspace(uint8_t c) { return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F); }

/* rules.is_csv_content_type: ct.split(";")[0].strip().lower() == CSV_CONTENT_TYPE; 1, 0 or decline. */
static int csv_content_type(Span ct) {
    if (ct.ptr == NULL)
        return 0;
    if (!is_ascii(ct))
        return J_DECLINE;
    const uint8_t *p = ct.ptr, *end = memchr(ct.ptr, ';', ct.len);
    if (end == NULL)
        end = ct.ptr + ct.len;
    while (p < end && ascii_isspace(*p))
        p++;
    while (end > p && ascii_isspace(end[-1]))
        end--;
    const RuleText *want = &RULES.csv_content_type;
    if ((size_t)(end - p) != want->len)
        return 0;
    for (size_t i = 0; i < want->len; i++)
        if (ascii_lower(p[i]) != want->s[i])
            return 0;
    return 1;
}

void row_reset(Row *row) {
    Span null_span = {NULL, 0};
    row->event_id = row->inference_id = row->inference_time = row->model = row->finish_reason = null_span;
    row->format = row->raw = 0;
    row->temperature.has = row->top_p.has = row->max_tokens.has = 0;
    row->turns.len = row->pieces.len = 0;
    arena_reset(&row->arena);
}

void row_free(Row *row) {
    buf_free(&row->turns);
    buf_free(&row->pieces);
    arena_free(&row->arena);
}

static int outcome(int r) { return r == J_NOMEM ? J_NOMEM : LINE_DECLINED; }

int capture_line(const uint8_t *line, size_t n, Row *row) {
    Scan s = {line, line + n};
    Side in, out;
    memset(&out, 0, sizeof out);
    int r = parse_line(&s, &row->arena, &in, &out, row);
    if (r != J_OK)
        return outcome(r);
    /* The order of batchpath.decode_chunk_msgspec: output side, input side, tabular, exchange. */
    int in_kind = side_kind(in.encoding);
    Span req, resp = {NULL, 0};
    int req_status = side_text(&in, in_kind, &row->arena, &req);
    if (req_status == J_NOMEM)
        return J_NOMEM;
    if (out.present && (r = side_text(&out, side_kind(out.encoding), &row->arena, &resp)) != J_OK)
        return outcome(r);
    if (req_status != J_OK)
        return LINE_DECLINED;
    if (in_kind == KIND_CSV)
        return LINE_SKIP;
    int csv = csv_content_type(in.content_type);
    if (csv < 0)
        return LINE_DECLINED;
    if (csv)
        return LINE_SKIP; /* tabular traffic */
    if (!out.present)
        return LINE_DECLINED;
    r = decode_exchange(req, resp, out.content_type, row);
    return r == J_OK ? LINE_ROW : outcome(r);
}

/* ---- columns ---------------------------------------------------------------------- */

int columns_init(Columns *c) {
    if (BASE64_VALUE['='] != 0xFF) /* not built yet */
        base64_table_init();
    memset(c, 0, sizeof *c);
    int32_t zero = 0;
    TRY(buf_put(&c->conv_offsets, &zero, sizeof zero));
    StrCol *cols[] = {&c->from,  &c->value,  &c->event_id,     &c->inference_id,
                      &c->inference_time, &c->model, &c->format, &c->finish_reason};
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++)
        TRY(str_col_init(cols[i]));
    return J_OK;
}

int columns_add(Columns *c, const Row *row, int64_t index) {
    const Turn *turns = (const Turn *)row->turns.data;
    const Span *pieces = (const Span *)row->pieces.data;
    size_t n_turns = row->turns.len / sizeof(Turn);
    if ((uint64_t)c->turns + n_turns > (uint64_t)INT32_MAX)
        return J_NOMEM;
    for (size_t t = 0; t < n_turns; t++) {
        Span from = from_name(turns[t].from);
        TRY(str_col_append(&c->from, &from, 1, 0));
        TRY(str_col_append(&c->value, pieces + turns[t].first, turns[t].count, 0));
    }
    c->turns += (int64_t)n_turns;
    int32_t end = (int32_t)c->turns;
    TRY(buf_put(&c->conv_offsets, &end, sizeof end));
    TRY(buf_put(&c->index, &index, sizeof index));
    TRY(str_col_span(&c->event_id, row->event_id));
    TRY(str_col_span(&c->inference_id, row->inference_id));
    TRY(str_col_span(&c->inference_time, row->inference_time));
    TRY(str_col_span(&c->model, row->model));
    TRY(str_col_span(&c->format, rule_span(&RULES.formats[row->format])));
    TRY(str_col_span(&c->finish_reason, row->finish_reason));
    TRY(bitmap_append(&c->raw, c->rows, row->raw));
    TRY(fixed_col_append(&c->temperature, &row->temperature.v, 8, row->temperature.has));
    TRY(fixed_col_append(&c->top_p, &row->top_p.v, 8, row->top_p.has));
    TRY(fixed_col_append(&c->max_tokens, &row->max_tokens.v, 8, row->max_tokens.has));
    c->rows++;
    return J_OK;
}

void columns_free(Columns *c) {
    buf_free(&c->index);
    buf_free(&c->conv_offsets);
    StrCol *cols[] = {&c->from,  &c->value,  &c->event_id,     &c->inference_id,
                      &c->inference_time, &c->model, &c->format, &c->finish_reason};
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++)
        str_col_free(cols[i]);
    buf_free(&c->raw);
    fixed_col_free(&c->temperature);
    fixed_col_free(&c->top_p);
    fixed_col_free(&c->max_tokens);
}

/* ---- inferenceTime ---------------------------------------------------------------- */

/* Days from 1970-01-01 to y-m-d in the proleptic Gregorian calendar (Hinnant's days_from_civil). */
static int64_t days_from_civil(int64_t y, int m, int d) {
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

/* The layout's fields are read where rules.TIME_LAYOUT puts them (configure checked that the year
 * has four digits and the other fields two), every other byte is the layout's own. The ranges
 * are those of rules.TIME_REGEX: a year of 1000-9999, and each field within its calendar range. */
int canonical_time(const uint8_t *p, size_t n, int64_t *us) {
    static const int month_days[12] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    const Rules *r = &RULES;
    if (n != r->time_layout.len)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (r->time_digit[i] ? (p[i] < '0' || p[i] > '9') : p[i] != r->time_layout.s[i])
            return 0;
    int v[N_TIME_FIELDS];
    for (int f = 0; f < N_TIME_FIELDS; f++) {
        v[f] = 0;
        for (size_t k = 0; k < r->time_width[f]; k++)
            v[f] = v[f] * 10 + (p[r->time_at[f] + k] - '0');
    }
    int year = v[T_YEAR], mo = v[T_MONTH], d = v[T_DAY], h = v[T_HOUR], mi = v[T_MINUTE], se = v[T_SECOND];
    if (year < 1000 || mo < 1 || mo > 12 || d < 1 || d > month_days[mo - 1] || h > 23 || mi > 59 || se > 59)
        return 0;
    int leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    if (mo == 2 && d == 29 && !leap)
        return 0;
    *us = ((days_from_civil(year, mo, d) * 24 + h) * 60 + mi) * 60 + se;
    *us *= 1000000;
    return 1;
}
