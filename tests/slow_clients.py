"""Idle and trickling connections from their own process:
`python tests/slow_clients.py HOST PORT IDLE TRICKLING OPEN_OVER_S`.

Opens IDLE connections that send nothing and TRICKLING ones that send a request a
byte every TRICKLE_S (half stall in the headers, half in the body), spread over
OPEN_OVER_S seconds, then prints "ready". Each connection the server closes is
opened again, as a slowloris client would. On SIGTERM it prints, as JSON, per kind
how long each connection lasted before the server closed it, and the status lines
the server answered with. Its own process keeps this client's work off the event
loop of the test that measures the streams beside it, and it runs at the lowest CPU
priority: slow clients elsewhere cost a server only its own side of their connections,
while on this 2-core machine this client's own work would take CPU time from the
server whose streams are measured (it used 4 % of a core, the server's side of the
connections 8 %).
"""

import json
import os
import selectors
import signal
import socket
import sys
import time

TRICKLE_S = 0.1
HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
SENDS = {  # per kind: what goes at once, then what trickles a byte at a time
    "idle": (b"", b""),
    "headers": (b"", HEADERS + b"X-Slow: " + b"s" * 4000),
    "body": (HEADERS + b"Content-Length: 4000\r\n\r\n", b" " * 4000),
}


class Connection:
    def __init__(self, kind: str, address: tuple[str, int]):
        self.kind = kind
        self.sock = socket.create_connection(address)
        self.opened = time.monotonic()
        at_once, self.pending = SENDS[kind]
        self.sock.sendall(at_once)
        self.sock.setblocking(False)
        self.next_send = self.opened + TRICKLE_S
        self.received = b""


def main(host: str, port: int, num_idle: int, num_trickling: int, open_over_s: float) -> None:
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    os.nice(19)
    address = (host, port)
    trickling = ["headers", "body"] * (num_trickling // 2)
    every = max(1, num_idle // max(1, len(trickling)))
    kinds = []  # the trickling ones spread among the idle ones
    for i in range(num_idle):
        if i % every == 0 and trickling:
            kinds.append(trickling.pop())
        kinds.append("idle")
    kinds += trickling
    lifetimes = {kind: [] for kind in SENDS}
    statuses: dict[str, int] = {}
    selector = selectors.DefaultSelector()
    live: dict[socket.socket, Connection] = {}

    def open_one(kind: str) -> None:
        conn = Connection(kind, address)
        live[conn.sock] = conn
        selector.register(conn.sock, selectors.EVENT_READ)

    def closed(conn: Connection) -> None:
        lifetimes[conn.kind].append(time.monotonic() - conn.opened)
        status = conn.received.split(b"\r\n", 1)[0].decode(errors="replace") or "none"
        statuses[status] = statuses.get(status, 0) + 1
        selector.unregister(conn.sock)
        del live[conn.sock]
        conn.sock.close()
        if not stopping:
            open_one(conn.kind)

    start = time.monotonic()
    for i, kind in enumerate(kinds):  # spread out, so the server closes them spread out
        time.sleep(max(0.0, start + open_over_s * i / len(kinds) - time.monotonic()))
        open_one(kind)
    print("ready", flush=True)
    while not stopping:
        now = time.monotonic()
        for conn in list(live.values()):
            if conn.pending and now >= conn.next_send:
                try:
                    conn.sock.send(conn.pending[:1])
                except OSError:
                    pass  # closed by the server: its read below says so
                conn.pending, conn.next_send = conn.pending[1:], now + TRICKLE_S
        for key, _ in selector.select(timeout=TRICKLE_S / 2):
            conn = live[key.fileobj]
            try:
                data = conn.sock.recv(1 << 16)
            except OSError:
                data = b""
            conn.received += data
            if not data:
                closed(conn)
    for conn in list(live.values()):
        conn.sock.close()
    print(json.dumps({"lifetimes": lifetimes, "statuses": statuses}), flush=True)


if __name__ == "__main__":
    host, port, num_idle, num_trickling, open_over_s = sys.argv[1:]
    main(host, int(port), int(num_idle), int(num_trickling), float(open_over_s))
