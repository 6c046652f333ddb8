#!/usr/bin/env bash
# The NBD server's memory under a client that keeps DEPTH reads of 1 MiB in flight and
# takes their replies steadily, a little slower than the server makes them (it sleeps
# 0.2 ms per 64 KiB read): `basalt target` exports a 1 GiB malloc bdev; the client (Python,
# fixed newstyle, simple replies) runs SECONDS; the target's resident memory is sampled
# every 2 s. Before 2026-11-29 the reply buffer was given back only when it emptied, which
# such a client never lets happen: 4.4 GB after 20 s.
#
# Usage: bench/nbd-steady-reader.sh
# Environment: SECONDS_RUN (default 20), DEPTH (default 64), PORT (default 10899),
# BASALT (default target/release/basalt).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_RUN=${SECONDS_RUN:-20}
DEPTH=${DEPTH:-64}
PORT=${PORT:-10899}
BASALT=${BASALT:-target/release/basalt}
[ -x "$BASALT" ] || cargo build --release -p basalt
work=$(mktemp -d "${TMPDIR:-/var/tmp}/basalt-nbd-steady.XXXXXX")
"$BASALT" target -r "$work/rpc.sock" >"$work/target.log" 2>&1 &
target=$!
trap 'kill "$target" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do [ -S "$work/rpc.sock" ] && break; sleep 0.1; done
rpc() { "$BASALT" rpc -s "$work/rpc.sock" "$@" >/dev/null; }
rpc bdev_malloc_create '{"name":"m0","num_blocks":262144,"block_size":4096}'
rpc nbd_server_start "{\"listen_address\":\"127.0.0.1\",\"port\":$PORT}"
rpc nbd_server_add_export '{"bdev_name":"m0","name":"m0"}'
rss() { awk '$1 == "VmRSS:" {print int($2 / 1024)}' "/proc/$target/status"; }
echo "target resident before: $(rss) MiB"
python3 - "$PORT" "$SECONDS_RUN" "$DEPTH" <<'PY' &
import socket, struct, sys, time
port, seconds, depth = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection(("127.0.0.1", port))
def take(n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise SystemExit("the server closed")
        data += chunk
    return data
take(18)  # greeting
s.sendall(struct.pack(">I", 1))  # fixed newstyle
s.sendall(struct.pack(">QII", 0x49484156454F5054, 1, 2) + b"m0")  # NBD_OPT_EXPORT_NAME
size, _flags = struct.unpack(">QH", take(10))
take(124)
request, sent = 1 << 20, 0
def send():
    global sent
    s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, sent, (sent * request) % size, request))
    sent += 1
for _ in range(depth):
    send()
end, replies = time.time() + seconds, 0
while time.time() < end:
    magic, error, _ = struct.unpack(">IIQ", take(16))
    assert magic == 0x67446698 and error == 0, (magic, error)
    left = request
    while left:
        chunk = s.recv(min(left, 65536))
        if not chunk:
            raise SystemExit("the server closed")
        left -= len(chunk)
        time.sleep(0.0002)
    replies += 1
    send()
print(f"client: {replies} replies of 1 MiB in {seconds:.0f} s")
PY
client=$!
for _ in $(seq $((SECONDS_RUN / 2))); do
    sleep 2
    echo "target resident: $(rss) MiB"
done
wait "$client"
