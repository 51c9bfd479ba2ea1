import dev.tandem.Conversation;
import dev.tandem.DeviceState;
import dev.tandem.Sampling;
import dev.tandem.Stats;
import dev.tandem.TandemException;
import dev.tandem.TandemRuntime;
import dev.tandem.ThermalState;
import dev.tandem.TokenStatus;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;

/**
 * Uses dev.tandem.TandemRuntime the way an app does and prints what it saw,
 * one fact per line, for jni/tests/java_program.rs to check:
 *
 * <pre>
 * java TandemRuntimeCheck generate CONFIG MODELS_DIR|- PROMPT MAX_TOKENS
 * java TandemRuntimeCheck lifecycle CONFIG PROMPT
 * java TandemRuntimeCheck conversation CONFIG FIRST SECOND MAX_TOKENS
 * </pre>
 */
public final class TandemRuntimeCheck {
    public static void main(String[] args) throws Exception {
        System.out.println("version " + TandemRuntime.version());
        switch (args[0]) {
            case "generate":
                generate(args[1], args[2].equals("-") ? null : args[2], args[3],
                        Integer.parseInt(args[4]));
                break;
            case "lifecycle":
                lifecycle(args[1], args[2]);
                break;
            case "conversation":
                conversation(args[1], args[2], args[3], Integer.parseInt(args[4]));
                break;
            default:
                throw new IllegalArgumentException("unknown mode " + args[0]);
        }
    }

    static String hex(String s) {
        StringBuilder b = new StringBuilder();
        for (byte x : s.getBytes(StandardCharsets.UTF_8)) {
            b.append(String.format("%02x", x));
        }
        return b.toString();
    }

    /** One generation: every piece with its status, then stats and JSON. */
    static void generate(String config, String modelsDir, String prompt, int maxTokens) {
        try (TandemRuntime rt = TandemRuntime.create(config, modelsDir)) {
            StringBuilder text = new StringBuilder();
            Stats s = rt.generate(prompt, maxTokens, (piece, status) -> {
                System.out.println("piece " + status + " " + hex(piece));
                text.append(piece);
                return true;
            });
            System.out.println("text " + text.toString().replace("\n", "\\n"));
            System.out.println("stats " + s);
            System.out.println("stats_again " + rt.stats());
            System.out.println("json " + rt.lastJson());
        }
        System.out.println("closed");
    }

    /**
     * Two turns of one conversation (pieces and the reuse counts per turn),
     * then what its close and a closed runtime do.
     */
    static void conversation(String config, String first, String second, int maxTokens) {
        TandemRuntime rt = TandemRuntime.create(config, null);
        Conversation c = rt.conversation();
        // Per-call sampling: refused before anything runs (the history stays
        // empty), and a seeded sampled call reproduces itself.
        System.out.println("bad_sampling " + thrown(() -> c.send(first, maxTokens,
                Sampling.GREEDY.withTopP(2f), null)));
        Sampling hot = Sampling.GREEDY.withTemperature(1.5f).withSeed(7);
        for (String name : new String[] {"seeded_a", "seeded_b"}) {
            StringBuilder t = new StringBuilder();
            rt.generate(first, 4, hot, (piece, status) -> {
                t.append(piece);
                return true;
            });
            System.out.println(name + " " + hex(t.toString()));
        }
        // Structured output: the answer follows the response format; one
        // that does not compile is refused before anything runs.
        StringBuilder yn = new StringBuilder();
        rt.generate(first, 8, Sampling.GREEDY.withResponseFormat(
                "{\"type\": \"grammar\", \"syntax\": \"regex\", \"definition\": \"(yes|no)\"}"),
                (piece, status) -> {
                    yn.append(piece);
                    return true;
                });
        System.out.println("format_regex " + yn);
        System.out.println("bad_format " + thrown(() -> rt.generate(first, 8,
                Sampling.GREEDY.withResponseFormat("{\"type\": \"grammar\", \"syntax\": "
                        + "\"regex\", \"definition\": \"(unclosed\"}"), null)));
        String[] turns = {first, second};
        for (int i = 0; i < turns.length; i++) {
            final int turn = i + 1;
            Stats s = c.send(turns[i], maxTokens, (piece, status) -> {
                System.out.println("turn" + turn + " piece " + status + " " + hex(piece));
                return true;
            });
            System.out.println("turn" + turn + " stats " + s + " draft_reused="
                    + s.draftReusedTokens + " verifier_reused=" + s.verifierReusedTokens);
        }
        System.out.println("send_in_callback " + thrown(() -> c.send(first, 2,
                (piece, status) -> {
                    c.send(first, 1, null);
                    return true;
                })));
        System.out.println("close_in_callback " + thrown(() -> c.send(first, 2,
                (piece, status) -> {
                    c.close();
                    return true;
                })));
        Conversation other = rt.conversation();
        c.close();
        c.close();
        System.out.println("closed " + c.isClosed());
        System.out.println("send_after_close " + thrown(() -> c.send(first, 1, null)));
        System.out.println("empty_message " + thrown(() -> other.send(" ", 1, null)));
        rt.close();
        System.out.println("send_after_runtime_close " + thrown(() -> other.send(first, 1, null)));
        other.close();
        System.out.println("done");
    }

    interface Call {
        void run() throws Exception;
    }

    /** What `call` threw, as "Class: message" (or "no exception"). */
    static String thrown(Call call) {
        try {
            call.run();
            return "no exception";
        } catch (TandemException e) {
            return "TandemException " + e.status() + ": " + e.getMessage();
        } catch (Exception e) {
            return e.getClass().getSimpleName() + ": " + e.getMessage();
        }
    }

    /** Errors, cancel from another thread, BUSY, callback exceptions, close. */
    static void lifecycle(String config, String prompt) throws Exception {
        System.out.println("missing_config " + thrown(
                () -> TandemRuntime.create(config + ".missing", null)));
        TandemRuntime rt = TandemRuntime.create(config, null);
        System.out.println("stats_before " + thrown(rt::stats));
        System.out.println("empty_prompt " + thrown(() -> rt.generate(" ", 4, null)));
        System.out.println("negative_max " + thrown(() -> rt.generate(prompt, -1, null)));

        // Cancel from another thread: the callback waits at its 3rd piece
        // until the main thread has cancelled, so the stop point is exact.
        CountDownLatch third = new CountDownLatch(1);
        CountDownLatch cancelled = new CountDownLatch(1);
        List<TokenStatus> seen = new ArrayList<>();
        AtomicReference<Object> result = new AtomicReference<>();
        Thread worker = new Thread(() -> {
            try {
                result.set(rt.generate(prompt, 64, (piece, status) -> {
                    seen.add(status);
                    if (seen.size() == 3) {
                        third.countDown();
                        try {
                            cancelled.await(60, TimeUnit.SECONDS);
                        } catch (InterruptedException e) {
                            Thread.currentThread().interrupt();
                        }
                    }
                    return true;
                }));
            } catch (RuntimeException e) {
                result.set(e);
            }
        });
        worker.start();
        if (!third.await(120, TimeUnit.SECONDS)) {
            throw new AssertionError("no 3rd piece within 120 s");
        }
        System.out.println("busy " + thrown(() -> rt.generate(prompt, 4, null)));
        rt.cancel();
        cancelled.countDown();
        worker.join();
        Stats c = (Stats) result.get();
        System.out.println("cancel stop=" + c.stop + " generated=" + c.generatedTokens
                + " pieces=" + seen.size() + " statuses=" + seen);

        // A cancel while nothing runs does not reach the next generation.
        rt.cancel();
        Stats second = rt.generate(prompt, 4, null);
        System.out.println("second stop=" + second.stop + " generated=" + second.generatedTokens);

        // The device state: hot and nearly empty means one draft thread and
        // one draft token per round; refused states change nothing; unknown
        // lifts it.
        rt.setDeviceState(new DeviceState(ThermalState.CRITICAL, 5, false, false, false));
        Stats hot = rt.generate(prompt, 4, null);
        System.out.println("device_hot threads=" + hot.draftThreads + " k_cap=" + hot.kCap
                + " generated=" + hot.generatedTokens);
        System.out.println("device_bad_battery " + thrown(() -> rt.setDeviceState(
                new DeviceState(ThermalState.NOMINAL, 101, false, false, false))));
        System.out.println("device_null " + thrown(() -> rt.setDeviceState(null)));
        System.out.println("device_null_thermal " + thrown(
                () -> new DeviceState(null, 50, false, false, false)));
        Stats still = rt.generate(prompt, 4, null);
        System.out.println("device_after_refusals threads=" + still.draftThreads
                + " k_cap=" + still.kCap);
        rt.setDeviceState(new DeviceState(ThermalState.UNKNOWN, -1, false, false, false));
        Stats cool = rt.generate(prompt, 4, null);
        System.out.println("device_unknown threads=" + cool.draftThreads + " k_cap=" + cool.kCap);

        // The callback's exception propagates out of generate and stops it;
        // the runtime stays usable.
        int[] n = {0};
        System.out.println("callback_throws " + thrown(() -> rt.generate(prompt, 64, (p, s) -> {
            if (++n[0] == 2) {
                throw new IllegalStateException("the app's callback failed");
            }
            return true;
        })));
        Stats after = rt.stats();
        System.out.println("after_throw stop=" + after.stop + " generated=" + after.generatedTokens);
        System.out.println("close_in_callback " + thrown(() -> rt.generate(prompt, 8, (p, s) -> {
            rt.close();
            return true;
        })));
        System.out.println("closed_after_callback " + rt.isClosed());

        // close() from another thread while a generation runs: it cancels the
        // generation and waits for it, then frees.
        CountDownLatch second2 = new CountDownLatch(1);
        AtomicReference<Object> r2 = new AtomicReference<>();
        Thread w2 = new Thread(() -> {
            try {
                r2.set(rt.generate(prompt, 64, (p, s) -> {
                    second2.countDown();
                    return true;
                }));
            } catch (RuntimeException e) {
                r2.set(e);
            }
        });
        w2.start();
        if (!second2.await(120, TimeUnit.SECONDS)) {
            throw new AssertionError("no piece within 120 s");
        }
        rt.close();
        w2.join();
        Stats during = (Stats) r2.get();
        System.out.println("close_during stop=" + during.stop + " closed=" + rt.isClosed());

        System.out.println("after_close_generate " + thrown(() -> rt.generate(prompt, 4, null)));
        System.out.println("after_close_cancel " + thrown(rt::cancel));
        System.out.println("after_close_stats " + thrown(rt::stats));
        System.out.println("close_twice " + thrown(rt::close));
    }
}
