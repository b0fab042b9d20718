"""The check every server test ends with (tests/serving.py's check_invariants) can fail:
a request still holding its output buffer keeps the server from being whole."""

import json
import socket
from urllib.parse import urlsplit

import pytest
from serving import check_invariants, running_server

pytestmark = pytest.mark.slow  # starts a server

FLAGS = ["--max-batch", "4", "--token-budget", "32", "--num-pages", "256", "--max-model-len",
         "2048", "--stream-buffer", "4096"]


def test_the_check_fails_while_an_unread_stream_holds_its_buffer(tiny_model):
    """A streamed answer the client never reads (~400 kB: past what the sockets hold):
    the engine finishes it into its buffer (room for all of it), the server's writes
    block, and the buffer stays allocated until the client goes (or the write timeout,
    30 s, drops it)."""
    with running_server(tiny_model, *FLAGS) as (url, _):
        address = urlsplit(url)
        body = json.dumps({"prompt": "Hi", "max_tokens": 2000, "ignore_eos": True,
                           "stream": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((address.hostname, address.port))
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            with pytest.raises(AssertionError, match=r"num_output_streams 1|running 1"):
                check_invariants(url, idle_timeout_s=3)
        finally:
            sock.close()  # the server's next write fails: the request ends, the check passes
