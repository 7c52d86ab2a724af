#!/usr/bin/env bash
# GPU check of the server path: ninfer-serve on CUDA, /health 503 -> 200, one aggregate and
# one streamed chat request, SIGTERM -> exit 0. Writes the log to $OUT/serve.log.
set -uo pipefail
PORT=${PORT:-18080}
ninfer-serve tiny:qwen3 --device 0 --port "$PORT" --log-stats-interval-ms 1000 > "$OUT/serve.log" 2>&1 &
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
kill -TERM "$pid"; wait "$pid"; echo "ninfer-serve exit code $?"
tail -n 12 "$OUT/serve.log"
