"""A guardrail checker for the jaxserve gateway: a template to copy, with a regex rule.

The gateway asks a checker about each prompt (kind "input") and about each window of a
streamed answer (kind "output"):

    POST /check  {"kind": "input" | "output", "model": "<model name>", "text": "..."}

and expects, with status 200, within the check's `timeout_s`:

    {"allowed": true}
    {"allowed": false, "reason": "shown to the client"}

Anything else — a timeout, a refused connection, another status, a body without a
boolean "allowed" — is a failed check, settled by the check's `policy` (fail_open or
fail_closed) in the gateway's configuration. Replace `verdict` with your own rule.

    python examples/guardrail_checker.py --port 8701 --deny "secret" --deny "pass(word)?"

`GET /health` answers 200; `GET /stats` counts the checks asked, by kind (tests read it).
`--hang` and `--delay-s` make a checker that never answers or answers late, for trying
out the gateway's policies.
"""

import argparse
import asyncio
import re

from aiohttp import web

KINDS = ("input", "output")
DENY = web.AppKey("deny", list[re.Pattern])
STATS = web.AppKey("stats", dict[str, int])
HANG = web.AppKey("hang", bool)
DELAY_S = web.AppKey("delay_s", float)


def verdict(text: str, deny: list[re.Pattern]) -> dict:
    """The rule: refuse text that any deny pattern matches."""
    for pattern in deny:
        if pattern.search(text):
            return {"allowed": False, "reason": f"matched rule {pattern.pattern}"}
    return {"allowed": True}


async def check(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not (isinstance(body, dict) and body.get("kind") in KINDS
            and isinstance(body.get("text"), str)):
        return web.json_response({"error": 'expected {"kind", "model", "text"}'}, status=400)
    kind, text = body["kind"], body["text"]
    request.app[STATS][kind] += 1  # on arrival, so a test can tell a --hang checker was asked
    if request.app[HANG]:
        await asyncio.Event().wait()  # never set: the gateway's timeout must end the wait
    await asyncio.sleep(request.app[DELAY_S])
    return web.json_response(verdict(text, request.app[DENY]))


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS])


def make_app(deny: list[re.Pattern], hang: bool = False, delay_s: float = 0.0) -> web.Application:
    app = web.Application()
    app[DENY] = deny
    app[STATS] = dict.fromkeys(KINDS, 0)
    app[HANG] = hang
    app[DELAY_S] = delay_s
    app.router.add_post("/check", check)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app


def _pattern(text: str) -> re.Pattern:
    try:
        return re.compile(text, re.IGNORECASE)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"bad regex {text!r}: {e}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8701)
    parser.add_argument("--deny", type=_pattern, action="append", default=[],
                        help="refuse text this regex matches (case-insensitive); repeatable")
    parser.add_argument("--hang", action="store_true", help="never answer a check")
    parser.add_argument("--delay-s", type=float, default=0.0, help="wait this long to answer")
    args = parser.parse_args()
    app = make_app(args.deny, hang=args.hang, delay_s=args.delay_s)
    # a check whose caller gave up (the gateway's timeout) is cancelled, not left running,
    # and a short shutdown bounds how long any still open (--hang) delay the exit
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                shutdown_timeout=1.0)


if __name__ == "__main__":
    main()
