"""Guardrail hooks: ask an external HTTP checker whether a prompt or an output may pass.

A checker is any service that answers `POST url {"kind", "model", "text"}` with
`{"allowed": bool, "reason": str}` (examples/guardrail_checker.py is a template). The
gateway never waits on one longer than its `timeout_s`, and a checker that fails (times
out, is unreachable, answers non-200 or nonsense) is settled by the check's `policy`, so
a broken checker costs a bounded delay and a known outcome, never a stuck request.
"""

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from gateway.config import CheckConfig

KINDS = ("input", "output")
OUTCOMES = ("allowed", "refused", "failed_open", "failed_closed")  # the metric's label values


@dataclass(frozen=True, slots=True)
class Verdict:
    """A check's answer. `reason` says why it refused or failed (also when it failed open,
    for the log); it never holds the checker's address, since clients may be shown it."""

    allowed: bool
    reason: str | None
    outcome: str  # one of OUTCOMES


class _CheckFailed(Exception):
    """The checker gave no usable answer; the message says how, in words fit for a client."""


class Guardrail:
    """One configured check, asked over a shared session; `on_outcome(check, kind,
    outcome)` is called once per check (the gateway counts them)."""

    def __init__(
        self,
        config: CheckConfig,
        session: aiohttp.ClientSession,
        on_outcome: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.config = config
        self.session = session
        self.on_outcome = on_outcome

    async def check(self, text: str, kind: str, model: str) -> Verdict:
        """Ask the checker about `text` (`kind` "input" or "output"); returns within
        `config.timeout_s` whatever the checker does."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        try:
            allowed, reason = await self._ask({"kind": kind, "model": model, "text": text})
        except _CheckFailed as e:
            verdict = self._failed(str(e))
        else:
            if allowed:
                verdict = Verdict(True, None, "allowed")
            else:
                verdict = Verdict(False, reason or f"refused by check {self.config.name}",
                                  "refused")
        if self.on_outcome is not None:
            self.on_outcome(self.config.name, kind, verdict.outcome)
        return verdict

    async def _ask(self, payload: dict) -> tuple[bool, str | None]:
        # One deadline over connect, send, headers and body: a checker that trickles its
        # answer byte by byte is as bounded as one that never answers.
        try:
            async with asyncio.timeout(self.config.timeout_s):
                async with self.session.post(self.config.url, json=payload) as resp:
                    if resp.status != 200:
                        raise _CheckFailed(f"answered HTTP {resp.status}")
                    body = await resp.read()
        except TimeoutError:
            raise _CheckFailed(f"timed out after {self.config.timeout_s:g}s") from None
        except (aiohttp.ClientError, OSError):  # refused, reset, closed mid-answer
            raise _CheckFailed("connection failed") from None
        try:
            answer = json.loads(body)
        except ValueError:  # not JSON, or not UTF-8
            raise _CheckFailed("answered no JSON") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("allowed"), bool):
            raise _CheckFailed('answered no boolean "allowed"')
        reason = answer.get("reason")
        return answer["allowed"], reason if isinstance(reason, str) else None

    def _failed(self, why: str) -> Verdict:
        reason = f"check {self.config.name} failed: {why}"
        if self.config.policy == "fail_open":
            return Verdict(True, reason, "failed_open")
        return Verdict(False, reason, "failed_closed")


class OutputWindows:
    """Cuts a streamed output into the pieces to check: a window once `window_chars` new
    characters have arrived, each led by the last `overlap_chars` of the text checked
    before, so a phrase split across two windows is still seen whole by one check."""

    def __init__(self, window_chars: int, overlap_chars: int = 64) -> None:
        if window_chars < 1 or overlap_chars < 0:
            raise ValueError(f"window_chars must be ≥ 1 and overlap_chars ≥ 0, "
                             f"not {window_chars} and {overlap_chars}")
        self.window_chars = window_chars
        self.overlap_chars = overlap_chars
        self._unchecked = ""
        self._checked_tail = ""  # the last overlap_chars of what was checked

    def feed(self, delta: str) -> str | None:
        """The text to check now, or None until a window's worth of new text has arrived."""
        self._unchecked += delta
        if len(self._unchecked) < self.window_chars:
            return None
        return self._take()

    def finish(self) -> str | None:
        """At the end of the stream: the unchecked tail (with overlap), or None if none."""
        return self._take() if self._unchecked else None

    def _take(self) -> str:
        window = self._checked_tail + self._unchecked
        self._checked_tail = window[-self.overlap_chars:] if self.overlap_chars else ""
        self._unchecked = ""
        return window


def input_text(body: dict) -> str:
    """The text an input check reads from an OpenAI request body: a chat's message
    contents, one per line, or a completion's prompt(s). Token-id prompts have no text
    (""); malformed parts are skipped, since the replica, not the check, rejects them."""
    if "messages" in body:
        messages = body["messages"] if isinstance(body["messages"], list) else []
        texts = (_message_text(m) for m in messages if isinstance(m, dict))
        return "\n".join(t for t in texts if t)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return ""


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts are joined as the server joins them for the model
        return "".join(
            p["text"] for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""
