"""Durable batch state in SQLite: uploaded files, batches and each batch's requests.

One connection, used from the gateway's event-loop thread only, and one gateway
process per database file. Every state change is a committed transaction before the
caller acts on it. A request's result is written once (only a `running` request
takes one), so an output file never holds a custom_id twice; on open, requests left
`running` by a gateway that died go back to `pending` and run again, while finished
results are kept. WAL with synchronous=NORMAL survives a process crash; a power cut
may undo the last commits, whose requests then simply run again.

Files and batches have an owner (the API layer's name for the caller's key): a caller
sees, uses and cancels only its own, and a batch's output files are its owner's.

A request's state: pending → running → done (any HTTP answer) or failed (the gateway
could not get one); running → pending (refused, or the runner stopped); pending or
running → expired (the deadline passed); pending → cancelled.
"""

import json
import re
import secrets
import sqlite3
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from server.protocol import APIError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
REQUEST_STATES = ("pending", "running", "done", "failed", "expired", "cancelled")
MAX_REQUESTS = 50_000  # lines of one input file, as OpenAI allows
WINDOW = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# a fresh `batch_req_<hex>` id for each row of a bulk update
NEW_RESULT_ID = "'batch_req_' || lower(hex(randomblob(12)))"

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    content BLOB NOT NULL,
    owner TEXT NOT NULL DEFAULT ''  -- who uploaded it (or whose batch wrote it)
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT,  -- the one model all its requests name; NULL when they name several
    metadata TEXT,  -- JSON
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    in_progress_at REAL,
    started_at REAL,  -- its first request started: the rate is measured from here
    cancelling_at REAL,
    finalizing_at REAL,
    completed_at REAL,
    expired_at REAL,
    cancelled_at REAL,
    output_file_id TEXT,
    error_file_id TEXT,
    owner TEXT NOT NULL DEFAULT ''  -- who created it: only they see it
);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,  -- 1-based line of the input file
    custom_id TEXT NOT NULL,
    method TEXT NOT NULL,
    url TEXT NOT NULL,
    model TEXT NOT NULL,
    body TEXT NOT NULL,  -- JSON
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    result_id TEXT,  -- `batch_req_<hex>`: its line's id in the output or error file
    status_code INTEGER,  -- done: the replica's HTTP status
    result TEXT,  -- JSON; done: {request_id, body}; otherwise: {code, message}
    finished_at REAL,
    PRIMARY KEY (batch_id, line),
    UNIQUE (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS requests_by_batch ON requests (batch_id, state);
CREATE INDEX IF NOT EXISTS requests_by_model ON requests (state, model);
"""
# columns added after a store could first be written: (table, column, definition), added
# on open to a store that lacks them (an existing file or batch belongs to no key, '')
ADDED_COLUMNS = (("files", "owner", "TEXT NOT NULL DEFAULT ''"),
                 ("batches", "owner", "TEXT NOT NULL DEFAULT ''"))


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: float


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One line of an input file, as the runner sends it."""

    batch_id: str
    line: int
    custom_id: str
    url: str
    model: str
    body: dict

    @property
    def key(self) -> tuple[str, int]:
        return self.batch_id, self.line


@dataclass(frozen=True, slots=True)
class Counts:
    total: int
    completed: int  # answered with a 2xx
    failed: int  # ended otherwise: a 4xx/5xx answer, failed, expired or cancelled
    finished: int  # answered or failed by the runner: what the measured rate counts
    remaining: int  # pending or running


@dataclass(frozen=True, slots=True)
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    model: str | None
    metadata: dict | None
    created_at: float
    expires_at: float
    in_progress_at: float | None
    started_at: float | None
    cancelling_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    expired_at: float | None
    cancelled_at: float | None
    output_file_id: str | None
    error_file_id: str | None
    counts: Counts

    def forecast(self, now: float) -> tuple[bool, float | None]:
        """(at_risk, estimated_completion_at) at this batch's measured rate (requests
        finished per second since its first started). Unknown, and not at risk, until
        one has finished or once it is no longer in progress."""
        c = self.counts
        if self.status != "in_progress" or self.started_at is None or not c.finished:
            return False, None
        rate = c.finished / max(now - self.started_at, 1e-3)
        eta = now + c.remaining / rate
        return eta > self.expires_at, eta


def parse_window(text: str, param: str = "completion_window") -> float:
    """Seconds in a duration such as "90s", "30m", "24h" or "2d"."""
    m = WINDOW.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None or float(m[1]) <= 0:
        raise APIError(400, f"{param} must be a positive duration such as '90s', '30m', "
                       f"'24h' or '2d', not {text!r}", param=param, code="invalid_value")
    return float(m[1]) * WINDOW_UNITS[m[2]]


def parse_input(content: bytes, endpoint: str,
                models: Collection[str] | None = None) -> list[tuple[str, str, dict]]:
    """(custom_id, method, body) of each line of an input file, which must be all
    valid, as OpenAI checks it when the batch is created."""

    def bad(line: int, why: str) -> APIError:
        where = f"line {line} of the input file" if line else "the input file"
        return APIError(400, f"{where}: {why}", param="input_file_id",
                        code="invalid_batch_input")

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(0, "not UTF-8") from None
    requests, seen = [], set()
    for n, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as e:
            raise bad(n, f"not valid JSON ({e.msg})") from None
        if not isinstance(item, dict):
            raise bad(n, "not a JSON object")
        custom_id, body = item.get("custom_id"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            raise bad(n, "custom_id must be a non-empty string")
        if custom_id in seen:
            raise bad(n, f"custom_id {custom_id!r} repeats an earlier line's")
        if item.get("method") != "POST":
            raise bad(n, "method must be 'POST'")
        if item.get("url") != endpoint:
            raise bad(n, f"url {item.get('url')!r} is not the batch's endpoint {endpoint!r}")
        if not isinstance(body, dict):
            raise bad(n, "body must be a JSON object")
        if body.get("stream"):
            raise bad(n, "streaming is not available in a batch (body.stream must be false)")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad(n, "body.model must name a model")
        if models is not None and model not in models:
            raise bad(n, f"model {model!r} is not served here")
        if len(requests) == MAX_REQUESTS:
            raise bad(n, f"more than {MAX_REQUESTS} requests")
        seen.add(custom_id)
        requests.append((custom_id, "POST", body))
    if not requests:
        raise bad(0, "no requests")
    return requests


class BatchStore:
    def __init__(self, path: str | Path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)  # transactions are explicit
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        for table, column, definition in ADDED_COLUMNS:
            have = {row["name"] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        with self._tx() as db:  # what a gateway that died left running runs again
            db.execute("UPDATE requests SET state = 'pending' WHERE state = 'running'")
            cancelling = db.execute("SELECT id FROM batches WHERE status = 'cancelling'")
            for (batch_id,) in cancelling.fetchall():
                _end_pending(db, batch_id, "cancelled", "batch_cancelled",
                             "the batch was cancelled before this request ran", time.time())

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # files

    def create_file(self, content: bytes, filename: str, purpose: str,
                    owner: str = "") -> StoredFile:
        with self._tx() as db:
            file_id = _insert_file(db, content, filename, purpose, time.time(), owner)
        return self.get_file(file_id)

    def get_file(self, file_id: str, owner: str | None = None) -> StoredFile | None:
        """The file, if it exists and (given an `owner`) is that owner's."""
        row = self._db.execute(
            "SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = :id"
            " AND (:owner IS NULL OR owner = :owner)", {"id": file_id, "owner": owner}
        ).fetchone()
        return None if row is None else StoredFile(*row)

    def file_content(self, file_id: str) -> bytes | None:
        row = self._db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def list_files(self, purpose: str | None = None, after: str | None = None,
                   limit: int = 10_000, newest_first: bool = True,
                   owner: str = "") -> list[StoredFile]:
        sign, order = ("<", "DESC") if newest_first else (">", "ASC")
        rows = self._db.execute(
            "SELECT id, purpose, filename, bytes, created_at FROM files"
            " WHERE owner = :owner AND (:purpose IS NULL OR purpose = :purpose)"
            f" AND (:after IS NULL OR seq {sign} (SELECT seq FROM files WHERE id = :after))"
            f" ORDER BY seq {order} LIMIT :limit",
            {"purpose": purpose, "after": after, "limit": limit, "owner": owner},
        )
        return [StoredFile(*row) for row in rows]

    # batches

    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict | None = None,
                     models: Collection[str] | None = None, owner: str = "") -> Batch:
        """Check the input file whole (APIError 400 naming the first bad line; 404 for an
        unknown file, or another owner's) and store the batch, in progress, with all its
        requests pending."""
        file = self.get_file(input_file_id, owner)
        if file is None:
            raise APIError(404, f"no file {input_file_id!r}", param="input_file_id")
        if file.purpose != "batch":
            raise APIError(400, f"file {input_file_id!r} has purpose {file.purpose!r}, "
                           "not 'batch'", param="input_file_id")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {list(ENDPOINTS)}", param="endpoint")
        window_s = parse_window(completion_window)
        requests = parse_input(self.file_content(input_file_id), endpoint, models)
        batch_id = f"batch_{secrets.token_hex(12)}"
        distinct = {body["model"] for _, _, body in requests}
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status,"
                " model, metadata, created_at, expires_at, in_progress_at, owner)"
                " VALUES (?, ?, ?, ?, 'in_progress', ?, ?, ?, ?, ?, ?)",
                (batch_id, endpoint, input_file_id, completion_window,
                 distinct.pop() if len(distinct) == 1 else None,
                 None if metadata is None else json.dumps(metadata), now, now + window_s, now,
                 owner),
            )
            db.executemany(
                "INSERT INTO requests (batch_id, line, custom_id, method, url, model, body)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                ((batch_id, i, cid, method, endpoint, body["model"], json.dumps(body))
                 for i, (cid, method, body) in enumerate(requests, 1)),
            )
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str, owner: str | None = None) -> Batch | None:
        """The batch, if it exists and (given an `owner`) is that owner's."""
        row = self._db.execute(
            "SELECT * FROM batches WHERE id = :id AND (:owner IS NULL OR owner = :owner)",
            {"id": batch_id, "owner": owner}).fetchone()
        return None if row is None else self._batch(row)

    def list_batches(self, after: str | None = None, limit: int = 20,
                     owner: str = "") -> list[Batch]:
        """`owner`'s batches, newest first; `after` is the id of the last batch of the
        previous page."""
        rows = self._db.execute(
            "SELECT * FROM batches WHERE owner = :owner AND (:after IS NULL OR"
            " seq < (SELECT seq FROM batches WHERE id = :after)) ORDER BY seq DESC LIMIT :limit",
            {"after": after, "limit": limit, "owner": owner},
        ).fetchall()
        return [self._batch(row) for row in rows]

    def cancel(self, batch_id: str, owner: str | None = None) -> Batch:
        """Start cancelling: its pending requests end `cancelled`, running ones finish."""
        batch = self.get_batch(batch_id, owner)
        if batch is None:
            raise APIError(404, f"no batch {batch_id!r}", param="batch_id")
        if batch.status in ("cancelling", "cancelled"):
            return batch
        if batch.status != "in_progress":
            raise APIError(400, f"batch {batch_id!r} is {batch.status}: it cannot be cancelled",
                           param="batch_id")
        now = time.time()
        with self._tx() as db:
            db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                       (now, batch_id))
            _end_pending(db, batch_id, "cancelled", "batch_cancelled",
                         "the batch was cancelled before this request ran", now)
        return self.get_batch(batch_id)

    def due(self, now: float) -> list[str]:
        """Batches in progress past their deadline."""
        rows = self._db.execute(
            "SELECT id FROM batches WHERE status = 'in_progress' AND expires_at <= ?", (now,))
        return [r[0] for r in rows]

    def settled(self) -> list[str]:
        """Batches in progress or cancelling with nothing left to run: to finalize."""
        rows = self._db.execute(
            "SELECT id FROM batches b WHERE status IN ('in_progress', 'cancelling')"
            " AND NOT EXISTS (SELECT 1 FROM requests r WHERE r.batch_id = b.id"
            " AND r.state IN ('pending', 'running'))")
        return [r[0] for r in rows]

    def expire(self, batch_id: str, now: float) -> list[tuple[str, int]]:
        """End the batch `expired`: its unfinished requests go to the error file. Returns
        the keys of the requests that were running, whose sends the caller stops."""
        with self._tx() as db:
            running = [(batch_id, r[0]) for r in db.execute(
                "SELECT line FROM requests WHERE batch_id = ? AND state = 'running'",
                (batch_id,))]
            db.execute("UPDATE requests SET state = 'pending' WHERE batch_id = ?"
                       " AND state = 'running'", (batch_id,))
            _end_pending(db, batch_id, "expired", "batch_expired",
                         "the batch's completion window ended before this request finished",
                         now)
            _finalize(db, batch_id, "expired", now)
        return running

    def finalize(self, batch_id: str) -> None:
        """Write the output and error files of a settled batch and end it: completed, or
        cancelled if it was cancelling."""
        with self._tx() as db:
            (status,) = db.execute("SELECT status FROM batches WHERE id = ?",
                                   (batch_id,)).fetchone()
            _finalize(db, batch_id, "cancelled" if status == "cancelling" else "completed",
                      time.time())

    # requests

    def request_states(self) -> dict[str, int]:
        """Requests of every batch by state (pending, running, done, failed, ...)."""
        rows = self._db.execute("SELECT state, COUNT(*) FROM requests GROUP BY state")
        return dict(rows.fetchall())

    def pending_models(self) -> list[str]:
        """Models with requests waiting to run, the one with the earliest deadline first."""
        rows = self._db.execute(
            "SELECT r.model FROM requests r JOIN batches b ON b.id = r.batch_id"
            " WHERE r.state = 'pending' AND b.status = 'in_progress'"
            " GROUP BY r.model ORDER BY MIN(b.expires_at)")
        return [r[0] for r in rows]

    def pending(self, model: str, limit: int) -> list[BatchRequest]:
        """The next requests for `model` to run: earliest deadline first, in file order."""
        rows = self._db.execute(
            "SELECT r.batch_id, r.line, r.custom_id, r.url, r.model, r.body"
            " FROM requests r JOIN batches b ON b.id = r.batch_id"
            " WHERE r.state = 'pending' AND r.model = ? AND b.status = 'in_progress'"
            " ORDER BY b.expires_at, b.seq, r.line LIMIT ?", (model, limit))
        return [BatchRequest(*row[:5], json.loads(row[5])) for row in rows]

    def mark_running(self, key: tuple[str, int]) -> bool:
        """Whether the request was pending and now runs."""
        now = time.time()
        with self._tx() as db:
            cur = db.execute("UPDATE requests SET state = 'running', attempts = attempts + 1"
                             " WHERE batch_id = ? AND line = ? AND state = 'pending'", key)
            if cur.rowcount == 1:
                db.execute("UPDATE batches SET started_at = COALESCE(started_at, ?)"
                           " WHERE id = ?", (now, key[0]))
        return cur.rowcount == 1

    def mark_done(self, key: tuple[str, int], status_code: int, body: object) -> bool:
        """Store a running request's answer; False if it had ended meanwhile (expired)."""
        request_id = body.get("id") if isinstance(body, dict) else None
        if not isinstance(request_id, str):
            request_id = f"req_{secrets.token_hex(12)}"
        result = json.dumps({"request_id": request_id, "body": body})
        return self._finish(key, "done", status_code, result)

    def mark_failed(self, key: tuple[str, int], code: str, message: str) -> bool:
        """End a running request without an answer: it goes to the error file."""
        return self._finish(key, "failed", None, json.dumps({"code": code, "message": message}))

    def requeue(self, key: tuple[str, int]) -> bool:
        """A running request that did not run goes back to pending."""
        with self._tx() as db:
            cur = db.execute("UPDATE requests SET state = 'pending'"
                             " WHERE batch_id = ? AND line = ? AND state = 'running'", key)
        return cur.rowcount == 1

    def _finish(self, key: tuple[str, int], state: str, status_code: int | None,
                result: str) -> bool:
        with self._tx() as db:
            cur = db.execute(
                f"UPDATE requests SET state = ?, status_code = ?, result = ?,"
                f" result_id = {NEW_RESULT_ID}, finished_at = ?"
                " WHERE batch_id = ? AND line = ? AND state = 'running'",
                (state, status_code, result, time.time(), *key))
        return cur.rowcount == 1

    def _batch(self, row: sqlite3.Row) -> Batch:
        fields = dict(row)
        del fields["seq"], fields["owner"]  # the owner is the store's to check, not shown
        if fields["metadata"] is not None:
            fields["metadata"] = json.loads(fields["metadata"])
        return Batch(**fields, counts=self._counts(row["id"]))

    def _counts(self, batch_id: str) -> Counts:
        by = {"pending": 0, "running": 0, "done": 0, "failed": 0, "expired": 0, "cancelled": 0}
        ok = 0
        for state, status_code, n in self._db.execute(
                "SELECT state, status_code, COUNT(*) FROM requests WHERE batch_id = ?"
                " GROUP BY state, status_code", (batch_id,)):
            by[state] += n
            ok += n if state == "done" and 200 <= status_code < 300 else 0
        total = sum(by.values())
        remaining = by["pending"] + by["running"]
        return Counts(total=total, completed=ok, failed=total - remaining - ok,
                      finished=by["done"] + by["failed"], remaining=remaining)


def _insert_file(db: sqlite3.Connection, content: bytes, filename: str, purpose: str,
                 now: float, owner: str) -> str:
    file_id = f"file-{secrets.token_hex(12)}"
    db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, content, owner)"
               " VALUES (?, ?, ?, ?, ?, ?, ?)",
               (file_id, purpose, filename, len(content), now, content, owner))
    return file_id


def _end_pending(db: sqlite3.Connection, batch_id: str, state: str, code: str, message: str,
                 now: float) -> None:
    """A batch's pending requests end unrun (expired or cancelled), for the error file."""
    db.execute(
        f"UPDATE requests SET state = ?, result = ?, result_id = {NEW_RESULT_ID},"
        " finished_at = ? WHERE batch_id = ? AND state = 'pending'",
        (state, json.dumps({"code": code, "message": message}), now, batch_id))


def _finalize(db: sqlite3.Connection, batch_id: str, status: str, now: float) -> None:
    """Write the output file (every answer) and the error file (every request that got
    none), each only when it has lines, and end the batch with `status`."""
    output, errors = [], []
    for custom_id, state, result_id, status_code, result in db.execute(
            "SELECT custom_id, state, result_id, status_code, result FROM requests"
            " WHERE batch_id = ? ORDER BY line", (batch_id,)):
        result = json.loads(result)
        if state == "done":
            response = {"status_code": status_code, "request_id": result["request_id"],
                        "body": result["body"]}
            output.append({"id": result_id, "custom_id": custom_id, "response": response,
                           "error": None})
        else:
            errors.append({"id": result_id, "custom_id": custom_id, "response": None,
                           "error": {"code": result["code"], "message": result["message"]}})
    (owner,) = db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
    files = []
    for lines, kind in ((output, "output"), (errors, "error")):
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        files.append(_insert_file(db, content, f"{batch_id}_{kind}.jsonl", "batch_output", now,
                                  owner) if lines else None)
    db.execute(
        f"UPDATE batches SET status = ?, finalizing_at = ?, {status}_at = ?,"
        " output_file_id = ?, error_file_id = ? WHERE id = ?",
        (status, now, now, *files, batch_id))
