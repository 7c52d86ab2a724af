#!/usr/bin/env bash
# GPU check of the server path: ninfer-serve on CUDA, /health 503 -> 200, one aggregate and
# one streamed chat request, then twelve concurrent streams of which four are cut off by
# their clients (decode steps run ahead on CUDA, so aborts land while a step is queued),
# then one more request, SIGTERM -> exit 0. Writes the log to $OUT/serve.log.
set -uo pipefail
PORT=${PORT:-18080}
ninfer-serve tiny:qwen3 --device 0 --port "$PORT" --max-concurrency 8 --log-stats-interval-ms 1000 > "$OUT/serve.log" 2>&1 &
pid=$!
for _ in $(seq 120); do
    code=$(curl -s -o /dev/null -w '%{http_code}' "localhost:$PORT/health")
    echo "health $code"
    [ "$code" = 200 ] && break
    sleep 0.5
done
curl -s "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":16,"seed":1}' | head -c 600; echo
curl -sN "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}' | tail -c 700; echo
body='{"messages":[{"role":"user","content":"count"}],"max_tokens":200,"stream":true}'
for i in $(seq 12); do
    limit=30; [ $((i % 3)) = 0 ] && limit=0.3  # every third client hangs up early
    curl -sN --max-time "$limit" "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' \
        -d "$body" > "$OUT/stream$i.txt" 2>/dev/null &
done
wait $(jobs -p | grep -v "^$pid$") 2>/dev/null
for i in $(seq 12); do printf 'stream %s: %s chunks, done=%s\n' "$i" "$(grep -c '^data: {' "$OUT/stream$i.txt")" \
    "$(grep -c '^data: \[DONE\]' "$OUT/stream$i.txt")"; done
curl -s "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"messages":[{"role":"user","content":"still there?"}],"max_tokens":8}' | head -c 400; echo
for text in "a" "a b c d e" "one two three four five six seven eight nine"; do  # new prompt lengths
    curl -s -o /dev/null -w "prompt '$text': %{time_total} s\n" "localhost:$PORT/v1/chat/completions" \
        -H 'content-type: application/json' -d "{\"messages\":[{\"role\":\"user\",\"content\":\"$text\"}],\"max_tokens\":4}"
done
echo "errors in log: $(grep -c -E 'ERROR|Traceback' "$OUT/serve.log")"
kill -TERM "$pid"; wait "$pid"; echo "ninfer-serve exit code $?"
tail -n 12 "$OUT/serve.log"
