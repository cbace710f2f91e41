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

/* A key equal to a rule's text. */
static int key_is(Span key, const RuleText *t) { return key.len == t->len && memcmp(key.ptr, t->s, t->len) == 0; }

/* A chat role a template renders as conversations' from/value says (RULES.plain_roles, as sent). */
static int plain_role(Span role) {
    for (int i = 0; i < N_PLAIN_ROLES; i++)
        if (key_is(role, &RULES.plain_roles[i]))
            return 1;
    return 0;
}

/* ---- whole exchanges (capture.formats' rules for what the reference keeps) ---------- */

/* The value at the cursor skipped, and its text in *raw. */
static int raw_value(Scan *s, int depth, Span *raw) {
    const uint8_t *start = s->p;
    TRY(json_skip(s, depth));
    raw->ptr = start;
    raw->len = (size_t)(s->p - start);
    return J_OK;
}

/* formats._check_tool_calls: a list of objects whose function is null or an object whose
 * arguments are null, an object or a string that parses as JSON. *nonempty: the list has
 * an item. Anything the reference would quarantine declines. */
static int check_tool_calls(Scan *s, Arena *a, int depth, int *nonempty) {
    *nonempty = 0;
    if (json_null(s))
        return J_OK;
    if (json_peek(s) != '[')
        return J_DECLINE;
    s->p++;
    int n = 0, r;
    while ((r = json_element(s, &n)) == 1) {
        if (json_peek(s) != '{')
            return J_DECLINE;
        s->p++;
        unsigned seen = 0;
        int cn = 0, cr;
        Span key;
        while ((cr = json_member(s, &cn, &key)) == 1) {
            if (!KEY(key, "function")) {
                TRY(json_skip(s, depth + 2));
                continue;
            }
            ONCE(seen, 1);
            if (json_null(s))
                continue;
            if (json_peek(s) != '{')
                return J_DECLINE;
            s->p++;
            unsigned fseen = 0;
            int fn = 0, fr;
            Span fkey;
            while ((fr = json_member(s, &fn, &fkey)) == 1) {
                if (!KEY(fkey, "arguments")) {
                    TRY(json_skip(s, depth + 3));
                    continue;
                }
                ONCE(fseen, 1);
                if (json_null(s))
                    continue;
                if (json_peek(s) == '{') {
                    TRY(json_skip(s, depth + 3));
                    continue;
                }
                Span args;
                TRY(json_str(s, a, &args));
                if (!json_valid_document(args.ptr, args.len))
                    return J_DECLINE; /* invalid_tool_call_arguments, or JSON this scanner declines */
            }
            if (fr != J_OK)
                return fr;
        }
        if (cr != J_OK)
            return cr;
    }
    if (r != J_OK)
        return r;
    *nonempty = n > 0;
    return J_OK;
}

/* Text into the arena (a turn's piece that is not in the line). */
static int arena_text(Arena *a, const Buf *b, Span *out) {
    uint8_t *p = arena_alloc(a, b->len + 1);
    if (p == NULL)
        return J_NOMEM;
    memcpy(p, b->data, b->len);
    out->ptr = p;
    out->len = b->len;
    return J_OK;
}

/* json.dumps(tool_calls, ensure_ascii=False) of the list at raw (the turn of a message that has
 * calls and no text), into the arena. */
static int calls_text(Row *row, Span raw, Span *out) {
    Scan t = {raw.ptr, raw.ptr + raw.len};
    row->ex.canon.len = 0;
    TRY(json_canon(&t, &row->ex.canon, 0, 1));
    return arena_text(&row->arena, &row->ex.canon, out);
}

/* formats._messages over OpenAI chat messages: a turn of each (role/content text, or the tool
 * calls as JSON text where there is no text); *plain stays 1 while every message is
 * role/content text of a plain role, which the turns render whole. */
static int parse_chat_messages(Scan *s, Row *row, int *human, int *plain) {
    if (json_peek(s) != '[')
        return J_DECLINE;
    s->p++;
    int n = 0, r;
    *plain = 1;
    while ((r = json_element(s, &n)) == 1) {
        if (json_peek(s) != '{')
            return J_DECLINE;
        s->p++;
        unsigned seen = 0;
        int mn = 0, mr, calls = 0;
        Span key, role = {NULL, 0}, content = {NULL, 0}, other, calls_raw = {NULL, 0};
        while ((mr = json_member(s, &mn, &key)) == 1) {
            if (KEY(key, "role")) {
                ONCE(seen, 1);
                TRY(json_str(s, &row->arena, &role));
            } else if (KEY(key, "content")) {
                ONCE(seen, 2);
                TRY(json_opt_str(s, &row->arena, &content)); /* a list of parts: the reference's */
            } else if (KEY(key, "tool_calls")) {
                ONCE(seen, 4);
                const uint8_t *start = s->p;
                TRY(check_tool_calls(s, &row->arena, 3, &calls));
                calls_raw.ptr = start;
                calls_raw.len = (size_t)(s->p - start);
            } else if (KEY(key, "reasoning") || KEY(key, "reasoning_content") || KEY(key, "tool_call_id") ||
                       KEY(key, "name")) {
                unsigned bit = KEY(key, "reasoning") ? 8 : KEY(key, "reasoning_content") ? 16
                               : KEY(key, "tool_call_id") ? 32 : 64;
                ONCE(seen, bit);
                TRY(json_opt_str(s, &row->arena, &other));
            } else {
                TRY(json_skip(s, 3));
            }
        }
        if (mr != J_OK)
            return mr;
        if (!(seen & 1))
            return J_DECLINE; /* missing_field */
        int from = role_from(role);
        if (from < 0)
            return J_DECLINE;
        if (!(plain_role(role) && mn == 2 && content.ptr != NULL))
            *plain = 0;
        *human |= from == FROM_HUMAN;
        Span text = content.ptr != NULL ? content : (Span){role.ptr, 0};
        if (text.len == 0 && calls)
            TRY(calls_text(row, calls_raw, &text));
        size_t first = n_pieces(row);
        TRY(push_piece(row, text));
        TRY(push_turn(row, from, first));
    }
    return r;
}

/* A list of objects (request.tools as the reference requires it). */
static int list_of_objects(Span raw) {
    Scan t = {raw.ptr, raw.ptr + raw.len};
    if (json_peek(&t) != '[')
        return 0;
    t.p++;
    int n = 0, r;
    while ((r = json_element(&t, &n)) == 1) {
        if (json_peek(&t) != '{' || json_skip(&t, 1) != J_OK)
            return 0;
    }
    return r == J_OK;
}

/* A value (as sent) in its canonical text. */
static int canon_into(Span raw, Buf *out) {
    Scan t = {raw.ptr, raw.ptr + raw.len};
    out->len = 0;
    return json_canon(&t, out, 0, 0);
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
    int plain;        /* chat: every message role/content text of a plain role */
    /* chat: the values as sent (ptr NULL: absent or null) */
    Span messages, tools, tool_choice, kwargs;
} Request;

/* Seen-bits of request members; B_MAX_TOKENS << i for RULES.max_tokens_keys[i]. */
enum { B_TEMPERATURE = 1, B_TOP_P = 2, B_MODEL = 4, B_MAIN = 8, B_PARAMETERS = 16, B_TOOLS = 32, B_TOOL_CHOICE = 64,
       B_KWARGS = 128, B_MAX_TOKENS = 256 };

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

/* batchpath._Msg: role and content, both strings. */
static int parse_message(Scan *s, Arena *a, int depth, Span *role, Span *content) {
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
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    if (r != J_OK)
        return r;
    return seen == 3 ? J_OK : J_DECLINE;
}

/* list[_Msg] → turns (batchpath._turns: known roles, non-empty content). */
static int parse_messages(Scan *s, Row *row, int depth, int *human) {
    if (json_peek(s) != '[')
        return J_DECLINE;
    s->p++;
    int n = 0, r;
    while ((r = json_element(s, &n)) == 1) {
        Span role, content;
        TRY(parse_message(s, &row->arena, depth + 1, &role, &content));
        int from = role_from(role);
        if (from < 0 || content.len == 0)
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
        return parse_messages(s, row, depth, &req->human);
    /* list[list[_Msg]]: exactly one dialog, or the batch is left to the reference. */
    if (json_peek(s) != '[')
        return J_DECLINE;
    s->p++;
    int n = 0, r;
    while ((r = json_element(s, &n)) == 1) {
        if (n > 1)
            return J_DECLINE;
        TRY(parse_messages(s, row, depth + 1, &req->human));
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
            const uint8_t *start = s.p;
            TRY(parse_chat_messages(&s, row, &req->human, &req->plain));
            req->messages.ptr = start;
            req->messages.len = (size_t)(s.p - start);
        } else if (kind == REQ_CHAT && (KEY(key, "tools") || KEY(key, "tool_choice") ||
                                        KEY(key, "chat_template_kwargs"))) {
            Span *into = KEY(key, "tools") ? &req->tools : KEY(key, "tool_choice") ? &req->tool_choice : &req->kwargs;
            ONCE(seen, KEY(key, "tools") ? B_TOOLS : KEY(key, "tool_choice") ? B_TOOL_CHOICE : B_KWARGS);
            if (!json_null(&s))
                TRY(raw_value(&s, 1, into));
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

/* Token ids at the cursor appended to `into` (*has: not null), as formats._token_ids takes them. */
static int token_ids(Scan *s, Buf *into, int *has) {
    int got;
    TRY(json_token_ids(s, into, &got));
    *has |= got;
    return J_OK;
}

/* One choice of a response (formats._openai_choice reads choice 0's). */
typedef struct {
    int has_message, content_null, calls_nonempty, has_prompt;
    Span content, text, finish_reason, reasoning, calls; /* calls: message.tool_calls as sent */
} Choice;

/* A choice; `first`: choice 0, whose ids go to the row (the prompt's to ex.ids until the
 * top-level ones are known). */
static int parse_choice(Scan *s, Row *row, int depth, Choice *c, int first) {
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r, ignored = 0;
    Span key;
    Exchange *ex = &row->ex;
    Arena *a = &row->arena;
    memset(c, 0, sizeof *c);
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "message")) {
            ONCE(seen, 1);
            if (json_null(s))
                continue;
            if (json_peek(s) != '{')
                return J_DECLINE;
            s->p++;
            c->has_message = 1;
            unsigned mseen = 0;
            int mn = 0, mr;
            Span mkey, reasoning = {NULL, 0}, reasoning_content = {NULL, 0};
            while ((mr = json_member(s, &mn, &mkey)) == 1) {
                if (KEY(mkey, "content")) {
                    ONCE(mseen, 1);
                    TRY(json_opt_str(s, a, &c->content)); /* a list of parts: the reference's */
                } else if (KEY(mkey, "reasoning")) {
                    ONCE(mseen, 2);
                    TRY(json_opt_str(s, a, &reasoning));
                } else if (KEY(mkey, "reasoning_content")) {
                    ONCE(mseen, 4);
                    TRY(json_opt_str(s, a, &reasoning_content));
                } else if (KEY(mkey, "tool_calls")) {
                    ONCE(mseen, 8);
                    const uint8_t *start = s->p;
                    TRY(check_tool_calls(s, a, depth + 2, &c->calls_nonempty));
                    c->calls.ptr = start;
                    c->calls.len = (size_t)(s->p - start);
                } else {
                    TRY(json_skip(s, depth + 2));
                }
            }
            if (mr != J_OK)
                return mr;
            c->content_null = c->content.ptr == NULL;
            c->reasoning = reasoning.ptr != NULL ? reasoning : reasoning_content;
        } else if (KEY(key, "text")) {
            ONCE(seen, 2);
            TRY(json_opt_str(s, a, &c->text));
        } else if (KEY(key, "finish_reason")) {
            ONCE(seen, 4);
            TRY(json_opt_str(s, a, &c->finish_reason));
        } else if (KEY(key, "token_ids")) {
            ONCE(seen, 8);
            if (first) {
                TRY(token_ids(s, &ex->output_ids, &ex->has_output_ids));
            } else {
                ex->canon.len = 0;
                TRY(token_ids(s, &ex->canon, &ignored));
            }
        } else if (KEY(key, "prompt_token_ids")) {
            ONCE(seen, 16);
            if (first) {
                TRY(token_ids(s, &ex->ids, &c->has_prompt));
            } else {
                ex->canon.len = 0;
                TRY(token_ids(s, &ex->canon, &ignored));
            }
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    return r;
}

/* formats._openai_choice's response: the first choice, the model, the prompt's token ids. */
static int openai_response(Span text, Row *row, Span *model, Choice *first) {
    Scan s = {text.ptr, text.ptr + text.len};
    json_ws(&s);
    if (json_peek(&s) != '{')
        return J_DECLINE;
    s.p++;
    unsigned seen = 0;
    int n = 0, r, n_choices = 0;
    Span key, object = {NULL, 0};
    Exchange *ex = &row->ex;
    memset(first, 0, sizeof *first);
    while ((r = json_member(&s, &n, &key)) == 1) {
        if (KEY(key, "choices")) {
            ONCE(seen, 1);
            if (json_peek(&s) != '[')
                return J_DECLINE;
            s.p++;
            int rc;
            while ((rc = json_element(&s, &n_choices)) == 1) {
                Choice c;
                TRY(parse_choice(&s, row, 2, &c, n_choices == 1));
                if (n_choices == 1)
                    *first = c;
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
            ONCE(seen, 8);
            TRY(token_ids(&s, &ex->prompt_ids, &ex->has_prompt_ids));
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
    /* The choice's prompt ids count where the response has none at the top. */
    if (!ex->has_prompt_ids && first->has_prompt) {
        TRY(buf_put(&ex->prompt_ids, ex->ids.data, ex->ids.len));
        ex->has_prompt_ids = 1;
    }
    return J_OK;
}

/* formats._merge_calls: streamed tool-call fragments (the list at raw) into ex.calls. */
static int merge_calls(Row *row, Span raw) {
    Exchange *ex = &row->ex;
    Scan s = {raw.ptr, raw.ptr + raw.len};
    if (json_peek(&s) != '[')
        return J_DECLINE;
    s.p++;
    int n = 0, r;
    while ((r = json_element(&s, &n)) == 1) {
        if (json_peek(&s) != '{')
            return J_DECLINE;
        s.p++;
        unsigned seen = 0;
        int fn_n = 0, fr, has_index = 0, has_fn = 0;
        int64_t index = 0;
        Span key, id = {NULL, 0}, type = {NULL, 0}, name = {NULL, 0}, args = {NULL, 0};
        while ((fr = json_member(&s, &fn_n, &key)) == 1) {
            if (KEY(key, "index")) {
                ONCE(seen, 1);
                TRY(json_int64(&s, &index)); /* null, a bool or a float: the reference quarantines */
                has_index = 1;
            } else if (KEY(key, "id") || KEY(key, "type")) {
                Span *into = KEY(key, "id") ? &id : &type;
                ONCE(seen, KEY(key, "id") ? 2 : 4);
                if (json_peek(&s) == '"')
                    TRY(json_string(&s, &row->arena, into));
                else
                    TRY(json_skip(&s, 4)); /* not a string: ignored */
            } else if (KEY(key, "function")) {
                ONCE(seen, 8);
                if (json_null(&s))
                    continue;
                if (json_peek(&s) != '{')
                    return J_DECLINE;
                s.p++;
                has_fn = 1;
                unsigned gseen = 0;
                int gn = 0, gr;
                Span gkey;
                while ((gr = json_member(&s, &gn, &gkey)) == 1) {
                    if (KEY(gkey, "name")) {
                        ONCE(gseen, 1);
                        if (json_peek(&s) == '"')
                            TRY(json_string(&s, &row->arena, &name));
                        else
                            TRY(json_skip(&s, 5));
                    } else if (KEY(gkey, "arguments")) {
                        ONCE(gseen, 2);
                        TRY(json_opt_str(&s, &row->arena, &args)); /* not a string: quarantined */
                    } else {
                        TRY(json_skip(&s, 5));
                    }
                }
                if (gr != J_OK)
                    return gr;
            } else {
                TRY(json_skip(&s, 4));
            }
        }
        if (fr != J_OK)
            return fr;
        if (!has_index)
            index = ex->n_calls; /* f.get("index", len(calls)) */
        StreamCall *call = NULL;
        for (int i = 0; i < ex->n_calls; i++)
            if (ex->calls[i].index == index)
                call = &ex->calls[i];
        if (call == NULL) {
            if (ex->n_calls == MAX_STREAM_CALLS)
                return J_DECLINE;
            call = &ex->calls[ex->n_calls++];
            call->index = index;
            call->id.ptr = call->type.ptr = call->name.ptr = NULL;
            call->n_keys = call->n_fn_keys = 0;
            call->arguments.len = 0;
        }
        if (id.ptr != NULL && call->id.ptr == NULL) {
            call->id = id;
            call->keys[call->n_keys++] = 0;
        }
        if (type.ptr != NULL && call->type.ptr == NULL) {
            call->type = type;
            call->keys[call->n_keys++] = 1;
        }
        if (!has_fn)
            continue;
        int fn_given = 0;
        for (int k = 0; k < call->n_keys; k++)
            fn_given |= call->keys[k] == 2;
        if (!fn_given)
            call->keys[call->n_keys++] = 2;
        if (name.ptr != NULL && call->name.ptr == NULL) {
            call->name = name;
            call->fn_keys[call->n_fn_keys++] = 0;
        }
        if (args.ptr != NULL) {
            int args_given = 0;
            for (int k = 0; k < call->n_fn_keys; k++)
                args_given |= call->fn_keys[k] == 1;
            if (!args_given)
                call->fn_keys[call->n_fn_keys++] = 1;
            TRY(buf_put(&call->arguments, args.ptr, args.len));
        }
    }
    return r;
}

/* The merged calls in the order of their indices, whose arguments must be JSON; *order gets it. */
static int calls_order(Exchange *ex, int *order) {
    for (int i = 0; i < ex->n_calls; i++) {
        int j = i;
        while (j > 0 && ex->calls[order[j - 1]].index > ex->calls[i].index) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    for (int i = 0; i < ex->n_calls; i++) {
        const StreamCall *c = &ex->calls[i];
        for (int k = 0; k < c->n_fn_keys; k++)
            if (c->fn_keys[k] == 1 && !json_valid_document(c->arguments.data ? c->arguments.data : (const uint8_t *)"",
                                                           c->arguments.len))
                return J_DECLINE; /* invalid_tool_call_arguments, or JSON this scanner declines */
    }
    return J_OK;
}

static int put_lit(Buf *out, const char *s) { return buf_put(out, s, strlen(s)); }

/* json.dumps of the merged calls (pretty: json.dumps' default separators). */
static int write_calls(const Exchange *ex, const int *order, Buf *out, int pretty) {
    const char *item = pretty ? ", " : ",", *colon = pretty ? ": " : ":";
    TRY(put_lit(out, "["));
    for (int i = 0; i < ex->n_calls; i++) {
        const StreamCall *c = &ex->calls[order[i]];
        if (i)
            TRY(put_lit(out, item));
        TRY(put_lit(out, "{"));
        for (int k = 0; k < c->n_keys; k++) {
            if (k)
                TRY(put_lit(out, item));
            if (c->keys[k] == 0 || c->keys[k] == 1) {
                Span v = c->keys[k] == 0 ? c->id : c->type;
                TRY(put_lit(out, c->keys[k] == 0 ? "\"id\"" : "\"type\""));
                TRY(put_lit(out, colon));
                TRY(json_canon_text(v.ptr, v.len, out));
                continue;
            }
            TRY(put_lit(out, "\"function\""));
            TRY(put_lit(out, colon));
            TRY(put_lit(out, "{"));
            for (int f = 0; f < c->n_fn_keys; f++) {
                if (f)
                    TRY(put_lit(out, item));
                TRY(put_lit(out, c->fn_keys[f] == 0 ? "\"name\"" : "\"arguments\""));
                TRY(put_lit(out, colon));
                if (c->fn_keys[f] == 0)
                    TRY(json_canon_text(c->name.ptr, c->name.len, out));
                else
                    TRY(json_canon_text(c->arguments.data ? c->arguments.data : (const uint8_t *)"", c->arguments.len,
                                        out));
            }
            TRY(put_lit(out, "}"));
        }
        TRY(put_lit(out, "}"));
    }
    return put_lit(out, "]");
}

/* formats._join_stream over one choice: choice 0's text, reasoning, tool-call fragments, finish
 * reason and token ids go to the row. */
static int parse_stream_choice(Scan *s, Row *row, int depth) {
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r, has_delta = 0;
    int64_t index = 0;
    Exchange *ex = &row->ex;
    Span key, content = {NULL, 0}, text = {NULL, 0}, finish = {NULL, 0}, reasoning = {NULL, 0},
              reasoning_content = {NULL, 0}, calls = {NULL, 0}, ids = {NULL, 0}, prompt = {NULL, 0};
    while ((r = json_member(s, &n, &key)) == 1) {
        if (KEY(key, "index")) {
            ONCE(seen, 1);
            TRY(json_int64(s, &index));
        } else if (KEY(key, "delta")) {
            ONCE(seen, 2);
            if (json_null(s))
                continue;
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
                } else if (KEY(dkey, "reasoning")) {
                    ONCE(dseen, 2);
                    TRY(json_opt_str(s, &row->arena, &reasoning));
                } else if (KEY(dkey, "reasoning_content")) {
                    ONCE(dseen, 4);
                    TRY(json_opt_str(s, &row->arena, &reasoning_content));
                } else if (KEY(dkey, "tool_calls")) {
                    ONCE(dseen, 8);
                    if (!json_null(s))
                        TRY(raw_value(s, depth + 2, &calls));
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
            ONCE(seen, KEY(key, "token_ids") ? 16 : 32);
            if (!json_null(s))
                TRY(raw_value(s, depth + 1, KEY(key, "token_ids") ? &ids : &prompt));
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    if (r != J_OK || index != 0)
        return r; /* n > 1 sampling: only choice 0 is the conversation */
    if (prompt.ptr != NULL) {
        Scan t = {prompt.ptr, prompt.ptr + prompt.len};
        ex->ids.len = 0;
        int has = 0;
        TRY(token_ids(&t, &ex->ids, &has));
        if (!ex->has_prompt_ids) {
            TRY(buf_put(&ex->prompt_ids, ex->ids.data, ex->ids.len));
            ex->has_prompt_ids = 1;
        }
    }
    if (ids.ptr != NULL) {
        Scan t = {ids.ptr, ids.ptr + ids.len};
        TRY(token_ids(&t, &ex->output_ids, &ex->has_output_ids));
    }
    if (finish.ptr != NULL)
        row->finish_reason = finish; /* the last one given */
    if (!has_delta)
        return text.ptr != NULL ? push_piece(row, text) : J_OK;
    if (content.ptr != NULL)
        TRY(push_piece(row, content));
    Span rs = reasoning.ptr != NULL ? reasoning : reasoning_content;
    if (rs.ptr != NULL) {
        TRY(buf_put(&ex->reasoning, &rs, sizeof rs));
        ex->has_reasoning = 1;
    }
    return calls.ptr != NULL ? merge_calls(row, calls) : J_OK;
}

/* One chunk of a stream; error events and TGI token streams are declined. */
static int parse_chunk(Scan *s, Row *row, int depth, Span *model) {
    if (json_peek(s) != '{')
        return J_DECLINE;
    s->p++;
    unsigned seen = 0;
    int n = 0, r;
    Exchange *ex = &row->ex;
    int had_prompt = ex->has_prompt_ids;
    size_t prompt_at = ex->prompt_ids.len;
    Span key, chunk_model = {NULL, 0}, prompt = {NULL, 0};
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
            ONCE(seen, 4);
            if (!json_null(s))
                TRY(raw_value(s, depth + 1, &prompt));
        } else if (KEY(key, "error") || KEY(key, "token") || KEY(key, "generated_text")) {
            return J_DECLINE;
        } else {
            TRY(json_skip(s, depth + 1));
        }
    }
    if (r != J_OK)
        return r;
    if (prompt.ptr != NULL) {
        /* The chunk's own prompt ids come before its choices' (and after earlier chunks'). */
        Scan t = {prompt.ptr, prompt.ptr + prompt.len};
        ex->ids.len = 0;
        int has = 0;
        TRY(token_ids(&t, &ex->ids, &has));
        if (!had_prompt) {
            ex->prompt_ids.len = prompt_at;
            TRY(buf_put(&ex->prompt_ids, ex->ids.data, ex->ids.len));
            ex->has_prompt_ids = 1;
        }
    }
    if (chunk_model.ptr != NULL)
        *model = chunk_model; /* the last chunk that names a model wins */
    return J_OK;
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

/* to_conversation's chat rules past the turns: the request's tools, tool_choice and
 * chat_template_kwargs, the whole exchange as messages where the turns are not all of it,
 * and the answer's turn text (the tool calls as JSON where there is no content). */
static int chat_exchange(Row *row, const Request *rq, size_t answer_first, int structured, int content_null,
                         Span calls, const int *order) {
    Exchange *ex = &row->ex;
    if (rq->kwargs.ptr != NULL && rq->kwargs.ptr[0] != '{')
        return J_DECLINE; /* wrong_type */
    if (rq->tools.ptr != NULL && !list_of_objects(rq->tools))
        return J_DECLINE; /* wrong_type */
    int sent = rq->tools.ptr != NULL || rq->tool_choice.ptr != NULL || rq->kwargs.ptr != NULL;
    int stream_calls = ex->n_calls > 0;
    const Span *pieces = (const Span *)row->pieces.data + answer_first;
    size_t count = n_pieces(row) - answer_first, total = 0;
    for (size_t i = 0; i < count; i++)
        total += pieces[i].len;
    if (sent || structured || !rq->plain) {
        Buf *m = &ex->messages;
        TRY(canon_into(rq->messages, m));
        if (m->len < 3 || m->data[m->len - 1] != ']')
            return J_DECLINE; /* no message: no user turn either */
        m->len--;
        TRY(put_lit(m, ",{\"role\":\"assistant\",\"content\":"));
        if (content_null) {
            TRY(put_lit(m, "null"));
        } else {
            TRY(put_lit(m, "\""));
            for (size_t i = 0; i < count; i++)
                TRY(json_escape_text(pieces[i].ptr, pieces[i].len, m));
            TRY(put_lit(m, "\""));
        }
        if (ex->has_reasoning) {
            TRY(put_lit(m, ",\"reasoning\":\""));
            const Span *rs = (const Span *)ex->reasoning.data;
            for (size_t i = 0; i < ex->reasoning.len / sizeof(Span); i++)
                TRY(json_escape_text(rs[i].ptr, rs[i].len, m));
            TRY(put_lit(m, "\""));
        }
        if (calls.ptr != NULL || stream_calls) {
            TRY(put_lit(m, ",\"tool_calls\":"));
            if (stream_calls) {
                TRY(write_calls(ex, order, m, 0));
            } else {
                Scan t = {calls.ptr, calls.ptr + calls.len};
                TRY(json_canon(&t, m, 0, 0));
            }
        }
        TRY(put_lit(m, "}]"));
        ex->has_messages = 1;
        if (rq->tools.ptr != NULL) {
            TRY(canon_into(rq->tools, &ex->tools));
            ex->has_tools = 1;
        }
        if (rq->tool_choice.ptr != NULL) {
            TRY(canon_into(rq->tool_choice, &ex->tool_choice));
            ex->has_tool_choice = 1;
        }
        if (rq->kwargs.ptr != NULL) {
            TRY(canon_into(rq->kwargs, &ex->kwargs));
            ex->has_kwargs = 1;
        }
    }
    if (total == 0 && (calls.ptr != NULL || stream_calls)) {
        /* Answer.text(): the calls as json.dumps writes them (default separators). */
        Span text;
        ex->canon.len = 0;
        if (stream_calls) {
            TRY(write_calls(ex, order, &ex->canon, 1));
            TRY(arena_text(&row->arena, &ex->canon, &text));
        } else {
            TRY(calls_text(row, calls, &text));
        }
        row->pieces.len = answer_first * sizeof(Span);
        TRY(push_piece(row, text));
    }
    return J_OK;
}

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
    Exchange *ex = &row->ex;
    int structured = 0, content_null = 0, order[MAX_STREAM_CALLS];
    Span calls = {NULL, 0}; /* a response message's tool calls as sent (not a stream's) */
    if (kind == REQ_CHAT || kind == REQ_COMPLETION) {
        if (sse) {
            TRY(stream_response(resp, row, &resp_model));
            TRY(calls_order(ex, order));
            structured = ex->has_reasoning || ex->n_calls > 0;
            if (kind == REQ_COMPLETION && structured)
                return J_DECLINE; /* reasoning or calls in a completion stream: the reference's */
            content_null = 1;
            for (size_t i = answer_first; i < n_pieces(row); i++)
                content_null &= ((const Span *)row->pieces.data)[i].len == 0;
        } else {
            Choice c;
            TRY(openai_response(resp, row, &resp_model, &c));
            if (kind == REQ_CHAT) {
                if (!c.has_message)
                    return J_DECLINE;
                Span content = c.content.ptr != NULL ? c.content : (Span){resp.ptr, 0};
                TRY(push_piece(row, content));
                content_null = c.content_null;
                if (c.reasoning.ptr != NULL) {
                    TRY(buf_put(&ex->reasoning, &c.reasoning, sizeof c.reasoning));
                    ex->has_reasoning = 1;
                }
                if (c.calls_nonempty)
                    calls = c.calls;
                structured = ex->has_reasoning || calls.ptr != NULL;
            } else {
                if (c.text.ptr == NULL)
                    return J_DECLINE;
                TRY(push_piece(row, c.text));
            }
            row->finish_reason = c.finish_reason;
        }
        if (kind == REQ_CHAT)
            TRY(chat_exchange(row, &rq, answer_first, structured, content_null, calls, order));
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
    if (((total == 0 || pieces_isspace(pieces, count)) && !structured) || !rq.human)
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
    Exchange *ex = &row->ex;
    ex->has_messages = ex->has_tools = ex->has_tool_choice = ex->has_kwargs = 0;
    ex->has_prompt_ids = ex->has_output_ids = ex->has_reasoning = ex->n_calls = 0;
    ex->messages.len = ex->tools.len = ex->tool_choice.len = ex->kwargs.len = 0;
    ex->prompt_ids.len = ex->output_ids.len = ex->ids.len = ex->reasoning.len = ex->canon.len = 0;
    arena_reset(&row->arena);
}

void row_free(Row *row) {
    buf_free(&row->turns);
    buf_free(&row->pieces);
    Exchange *ex = &row->ex;
    Buf *bufs[] = {&ex->messages, &ex->tools, &ex->tool_choice, &ex->kwargs, &ex->prompt_ids,
                   &ex->output_ids, &ex->ids, &ex->reasoning, &ex->canon};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        buf_free(bufs[i]);
    for (int i = 0; i < MAX_STREAM_CALLS; i++)
        buf_free(&ex->calls[i].arguments);
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
                      &c->inference_time, &c->model, &c->format, &c->finish_reason,
                      &c->messages, &c->tools, &c->tool_choice, &c->chat_template_kwargs};
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++)
        TRY(str_col_init(cols[i]));
    TRY(buf_put(&c->prompt_token_ids.offsets, &zero, sizeof zero));
    TRY(buf_put(&c->output_token_ids.offsets, &zero, sizeof zero));
    return J_OK;
}

/* A string column's value from a buffer (null unless has). */
static int buf_col(StrCol *c, const Buf *b, int has) {
    Span v = {b->data ? b->data : (const uint8_t *)"", b->len};
    return str_col_append(c, &v, has ? 1 : 0, !has);
}

static int ids_col_append(IdsCol *c, const Buf *ids, int has) {
    if (has) {
        if (ids->len / 4 > (size_t)INT32_MAX - c->values.len / 4)
            return J_NOMEM;
        TRY(buf_put(&c->values, ids->data, ids->len));
    }
    int32_t end = (int32_t)(c->values.len / 4);
    TRY(buf_put(&c->offsets, &end, sizeof end));
    TRY(bitmap_append(&c->validity, c->length, has));
    c->nulls += !has;
    c->length++;
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
    const Exchange *ex = &row->ex;
    TRY(buf_col(&c->messages, &ex->messages, ex->has_messages));
    TRY(buf_col(&c->tools, &ex->tools, ex->has_tools));
    TRY(buf_col(&c->tool_choice, &ex->tool_choice, ex->has_tool_choice));
    TRY(buf_col(&c->chat_template_kwargs, &ex->kwargs, ex->has_kwargs));
    TRY(ids_col_append(&c->prompt_token_ids, &ex->prompt_ids, ex->has_prompt_ids));
    TRY(ids_col_append(&c->output_token_ids, &ex->output_ids, ex->has_output_ids));
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
                      &c->inference_time, &c->model, &c->format, &c->finish_reason,
                      &c->messages, &c->tools, &c->tool_choice, &c->chat_template_kwargs};
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++)
        str_col_free(cols[i]);
    IdsCol *ids[] = {&c->prompt_token_ids, &c->output_token_ids};
    for (int i = 0; i < 2; i++) {
        buf_free(&ids[i]->offsets);
        buf_free(&ids[i]->values);
        buf_free(&ids[i]->validity);
    }
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
