/*
 * tandem_example.c: uses Tandem's C ABI (capi/include/tandem.h) end to end.
 *
 *   tandem_example CONFIG.toml PROMPT [MAX_TOKENS] [--cancel-after N]
 *   tandem_example CONFIG.toml PROMPT MAX_TOKENS --conversation FOLLOW_UP...
 *
 * Creates a runtime from CONFIG.toml (its relative model paths are relative
 * to the directory in the environment variable TANDEM_MODELS_DIR, where
 * `tandem models fetch` puts them; unset: to CONFIG.toml's directory),
 * generates an answer to PROMPT with a
 * per-piece callback, prints the text, the per-status counts and the
 * statistics, then frees everything. With --cancel-after N a second thread
 * cancels the generation once N pieces have arrived (and checks, while the
 * generation runs, that a concurrent tandem_generate is refused with BUSY and
 * that tandem_runtime_stats answers from another thread).
 *
 * Output lines (stdout), parsed by capi/tests/c_program.rs:
 *   version X
 *   text_hex <hex of the UTF-8 text>
 *   pieces verified=A provisional=B local=C
 *   stats route=R stop=S generated=N verified=V provisional=P local=L
 *         rounds=.. drafted=.. accepted=.. acceptance=.. passes=..
 *   json {...}
 *   cancel busy=<status name> stats_during=<status name>   (with --cancel-after)
 *   second stop=S generated=N   (with --cancel-after: a second generation on
 *                                the same runtime, 4 tokens, no callback)
 * With --conversation the PROMPT and each FOLLOW_UP are the user turns of one
 * conversation (tandem_conversation_new / _send / _free); per turn:
 *   turn I text_hex <hex> generated=N draft_reused=D verifier_reused=V dropped=X
 * Errors: "error <STATUS>: <message>" on stderr, exit code 2.
 *
 * Build: see examples/c/README.md.
 */
#include "tandem.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct state {
    const TandemRuntime *rt;
    /* text received so far */
    char *text;
    size_t len, cap;
    long pieces[3]; /* by TandemTokenStatus */
    /* cancel handshake (--cancel-after) */
    long cancel_after;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int reached;   /* the callback reached cancel_after pieces */
    int cancelled; /* the other thread called tandem_cancel */
    TandemStatus busy_status;
    TandemStatus stats_status;
};

static bool on_piece(const char *piece, size_t piece_len, TandemTokenStatus status,
                     void *user_data) {
    struct state *st = user_data;
    if (st->len + piece_len + 1 > st->cap) {
        st->cap = 2 * (st->len + piece_len + 1);
        st->text = realloc(st->text, st->cap);
        if (!st->text) {
            return false;
        }
    }
    memcpy(st->text + st->len, piece, piece_len);
    st->len += piece_len;
    st->text[st->len] = '\0';
    if (status >= 0 && status <= 2) {
        st->pieces[status]++;
    }
    fwrite(piece, 1, piece_len, stderr); /* live view */
    long n = st->pieces[0] + st->pieces[1] + st->pieces[2];
    if (st->cancel_after > 0 && n == st->cancel_after) {
        /* Wait until the other thread has cancelled: deterministic stop here. */
        pthread_mutex_lock(&st->mu);
        st->reached = 1;
        pthread_cond_broadcast(&st->cv);
        while (!st->cancelled) {
            pthread_cond_wait(&st->cv, &st->mu);
        }
        pthread_mutex_unlock(&st->mu);
    }
    return true;
}

static void *canceller(void *arg) {
    struct state *st = arg;
    pthread_mutex_lock(&st->mu);
    while (!st->reached) {
        pthread_cond_wait(&st->cv, &st->mu);
    }
    pthread_mutex_unlock(&st->mu);
    /* A generation is running on the other thread: a second one is refused. */
    char *err = NULL;
    st->busy_status = tandem_generate(st->rt, "hi", 1, NULL, NULL, NULL, &err);
    tandem_string_free(err);
    TandemStats s;
    st->stats_status = tandem_runtime_stats(st->rt, &s);
    tandem_cancel(st->rt);
    pthread_mutex_lock(&st->mu);
    st->cancelled = 1;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

static const char *route_name(TandemRoute r) {
    switch (r) {
    case TANDEM_ROUTE_LOCAL_NO_VERIFIER: return "local_no_verifier";
    case TANDEM_ROUTE_LOCAL_BY_ROUTER: return "local_by_router";
    case TANDEM_ROUTE_SPECULATIVE: return "speculative";
    }
    return "?";
}

static const char *stop_name(TandemStopReason s) {
    switch (s) {
    case TANDEM_STOP_REASON_END_OF_TURN: return "end_of_turn";
    case TANDEM_STOP_REASON_MAX_TOKENS: return "max_tokens";
    case TANDEM_STOP_REASON_CONTEXT_FULL: return "context_full";
    case TANDEM_STOP_REASON_CANCELLED: return "cancelled";
    }
    return "?";
}

static int fail(TandemStatus code, char *msg) {
    fprintf(stderr, "error %s: %s\n", tandem_status_name(code), msg ? msg : "(no message)");
    tandem_string_free(msg);
    return 2;
}

/* The --conversation mode: every argument from `first` on is a user turn. */
static int conversation(TandemRuntime *rt, int argc, char **argv, int first, unsigned max_tokens) {
    TandemConversation *conv = NULL;
    char *err = NULL;
    TandemStatus rc = tandem_conversation_new(rt, &conv, &err);
    if (rc != TANDEM_STATUS_OK) {
        tandem_runtime_free(rt);
        return fail(rc, err);
    }
    for (int i = first; i < argc; i++) {
        struct state st;
        memset(&st, 0, sizeof st);
        TandemStats stats;
        rc = tandem_conversation_send(rt, conv, argv[i], max_tokens, on_piece, &st, &stats, &err);
        fputc('\n', stderr);
        if (rc != TANDEM_STATUS_OK) {
            free(st.text);
            tandem_conversation_free(rt, conv);
            tandem_runtime_free(rt);
            return fail(rc, err);
        }
        printf("turn %d text_hex ", i - first + 1);
        for (size_t j = 0; j < st.len; j++) {
            printf("%02x", (unsigned char)st.text[j]);
        }
        printf(" generated=%llu draft_reused=%llu verifier_reused=%llu dropped=%llu\n",
               (unsigned long long)stats.generated_tokens,
               (unsigned long long)stats.draft_reused_tokens,
               (unsigned long long)stats.verifier_reused_tokens,
               (unsigned long long)stats.dropped_messages);
        free(st.text);
    }
    tandem_conversation_free(rt, conv);
    tandem_runtime_free(rt);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s CONFIG.toml PROMPT [MAX_TOKENS] [--cancel-after N]\n", argv[0]);
        return 1;
    }
    unsigned max_tokens = argc > 3 ? (unsigned)strtoul(argv[3], NULL, 10) : 0;
    struct state st;
    memset(&st, 0, sizeof st);
    pthread_mutex_init(&st.mu, NULL);
    pthread_cond_init(&st.cv, NULL);
    if (argc > 5 && strcmp(argv[4], "--cancel-after") == 0) {
        st.cancel_after = strtol(argv[5], NULL, 10);
    }
    printf("version %s\n", tandem_version());

    TandemRuntime *rt = NULL;
    char *err = NULL;
    /* An app passes its own model directory (e.g. its download directory). */
    const char *models_dir = getenv("TANDEM_MODELS_DIR");
    TandemStatus rc = tandem_runtime_new(argv[1], models_dir, &rt, &err);
    if (rc != TANDEM_STATUS_OK) {
        return fail(rc, err);
    }
    st.rt = rt;
    if (argc > 4 && strcmp(argv[4], "--conversation") == 0) {
        /* argv[2] is the first user turn, then every argument after the flag. */
        argv[4] = argv[2];
        return conversation(rt, argc, argv, 4, max_tokens);
    }
    pthread_t th;
    if (st.cancel_after > 0) {
        pthread_create(&th, NULL, canceller, &st);
    }
    TandemStats stats;
    rc = tandem_generate(rt, argv[2], max_tokens, on_piece, &st, &stats, &err);
    if (st.cancel_after > 0) {
        pthread_join(th, NULL);
    }
    fputc('\n', stderr);
    if (rc != TANDEM_STATUS_OK) {
        tandem_runtime_free(rt);
        return fail(rc, err);
    }
    printf("text_hex ");
    for (size_t i = 0; i < st.len; i++) {
        printf("%02x", (unsigned char)st.text[i]);
    }
    printf("\n");
    printf("pieces verified=%ld provisional=%ld local=%ld\n", st.pieces[TANDEM_TOKEN_STATUS_VERIFIED],
           st.pieces[TANDEM_TOKEN_STATUS_PROVISIONAL], st.pieces[TANDEM_TOKEN_STATUS_LOCAL]);
    /* The same statistics, read back through the stats entry point. */
    TandemStats again;
    rc = tandem_runtime_stats(rt, &again);
    if (rc != TANDEM_STATUS_OK || memcmp(&again.generated_tokens, &stats.generated_tokens,
                                         sizeof stats.generated_tokens) != 0) {
        fprintf(stderr, "tandem_runtime_stats disagrees with the generation's stats\n");
        tandem_runtime_free(rt);
        return 3;
    }
    printf("stats route=%s stop=%s generated=%llu verified=%llu provisional=%llu local=%llu "
           "rounds=%llu drafted=%llu accepted=%llu acceptance=%.3f passes=%llu\n",
           route_name(stats.route), stop_name(stats.stop),
           (unsigned long long)stats.generated_tokens, (unsigned long long)stats.verified_tokens,
           (unsigned long long)stats.provisional_tokens, (unsigned long long)stats.local_tokens,
           (unsigned long long)stats.rounds, (unsigned long long)stats.drafted,
           (unsigned long long)stats.accepted, stats.acceptance_rate,
           (unsigned long long)stats.verifier_passes);
    char *json = NULL;
    rc = tandem_runtime_last_json(rt, &json, &err);
    if (rc != TANDEM_STATUS_OK) {
        tandem_runtime_free(rt);
        return fail(rc, err);
    }
    printf("json %s\n", json);
    tandem_string_free(json);
    if (st.cancel_after > 0) {
        printf("cancel busy=%s stats_during=%s\n", tandem_status_name(st.busy_status),
               tandem_status_name(st.stats_status));
        /* The runtime is reusable, and a cancel while nothing runs does not
         * cancel the next generation. */
        tandem_cancel(rt);
        TandemStats second;
        rc = tandem_generate(rt, argv[2], 4, NULL, NULL, &second, &err);
        if (rc != TANDEM_STATUS_OK) {
            tandem_runtime_free(rt);
            return fail(rc, err);
        }
        printf("second stop=%s generated=%llu\n", stop_name(second.stop),
               (unsigned long long)second.generated_tokens);
    }
    tandem_runtime_free(rt);
    free(st.text);
    return 0;
}
