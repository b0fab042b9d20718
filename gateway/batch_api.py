"""OpenAI's Files and Batch endpoints over the batch store, in OpenAI's shapes.

Extensions: a batch's window may be any duration ("90s", "30m", "24h", "2d") and may
be given as `completeWithin`; a batch object also says whether it is `at_risk` of
missing its deadline at its measured rate, and its `estimated_completion_at`.
"""

import hashlib
import math
import time
from collections.abc import Collection

from aiohttp import BodyPartReader, web

from gateway.batch_runner import BatchRunner
from gateway.batch_store import Batch, BatchStore, StoredFile, parse_window
from server.protocol import APIError
from server.responses import json_response

MAX_FILE_BYTES = 200 << 20  # an uploaded file, as OpenAI allows for batch input
MAX_METADATA_KEYS = 16


def add_routes(app: web.Application, store: BatchStore, runner: BatchRunner,
               models: Collection[str] | None = None) -> None:
    """Serve /v1/files and /v1/batches. With `models`, a batch naming another model is
    refused when created (otherwise it would wait for capacity until it expires)."""
    api = _BatchAPI(store, runner, models)
    app.router.add_post("/v1/files", api.upload)
    app.router.add_get("/v1/files", api.list_files)
    app.router.add_get("/v1/files/{file_id}", api.get_file)
    app.router.add_get("/v1/files/{file_id}/content", api.file_content)
    app.router.add_post("/v1/batches", api.create)
    app.router.add_get("/v1/batches", api.list_batches)
    app.router.add_get("/v1/batches/{batch_id}", api.get)
    app.router.add_post("/v1/batches/{batch_id}/cancel", api.cancel)


def owner(request: web.Request) -> str:
    return owner_of(request.headers.get("Authorization", ""))


def owner_of(authorization: str) -> str:
    """Who is asking, as the store keeps it: a digest of the API key (never the key), or ""
    for callers with none. Each key sees only its own files and batches, as each OpenAI
    organization does."""
    return hashlib.sha256(authorization.encode()).hexdigest()[:32] if authorization else ""


def file_object(f: StoredFile) -> dict:
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": int(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed"}


def batch_object(b: Batch, now: float) -> dict:
    at_risk, eta = b.forecast(now)
    c = b.counts
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "model": b.model,
        "errors": None, "input_file_id": b.input_file_id,
        "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
        "created_at": int(b.created_at), "in_progress_at": _seconds(b.in_progress_at),
        "expires_at": int(b.expires_at), "finalizing_at": _seconds(b.finalizing_at),
        "completed_at": _seconds(b.completed_at), "failed_at": None,
        "expired_at": _seconds(b.expired_at), "cancelling_at": _seconds(b.cancelling_at),
        "cancelled_at": _seconds(b.cancelled_at),
        "request_counts": {"total": c.total, "completed": c.completed, "failed": c.failed},
        "metadata": b.metadata,
        "at_risk": at_risk, "estimated_completion_at": None if eta is None else math.ceil(eta),
    }


def _seconds(t: float | None) -> int | None:
    return None if t is None else int(t)


def _page(items: list[dict], limit: int) -> dict:
    """OpenAI's cursor page of up to `limit` items, from a query of `limit + 1`."""
    data = items[:limit]
    return {"object": "list", "data": data, "has_more": len(items) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def _limit(request: web.Request, default: int, most: int) -> int:
    raw = request.query.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise APIError(400, f"limit must be an integer from 1 to {most}", param="limit")
    return int(raw)


class _BatchAPI:
    def __init__(self, store: BatchStore, runner: BatchRunner, models: Collection[str] | None):
        self.store = store
        self.runner = runner
        self.models = models

    async def upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise APIError(400, "send multipart/form-data with a file and its purpose")
        content = filename = purpose = None
        async for part in await request.multipart():
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "file":
                filename = part.filename or "upload.jsonl"
                content = await _read_file(part)
            elif part.name == "purpose":
                purpose = (await part.text()).strip()
        if content is None:
            raise APIError(400, "no file in the form", param="file")
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch', not {purpose!r}", param="purpose")
        return json_response(file_object(
            self.store.create_file(content, filename, purpose, owner(request))))

    async def list_files(self, request: web.Request) -> web.Response:
        limit = _limit(request, 10_000, 10_000)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'", param="order")
        files = self.store.list_files(request.query.get("purpose"), request.query.get("after"),
                                      limit + 1, newest_first=order == "desc",
                                      owner=owner(request))
        return json_response(_page([file_object(f) for f in files], limit))

    async def get_file(self, request: web.Request) -> web.Response:
        return json_response(file_object(self._file(request)))

    async def file_content(self, request: web.Request) -> web.Response:
        file = self._file(request)
        return web.Response(body=self.store.file_content(file.id),
                            content_type="application/octet-stream")

    async def create(self, request: web.Request) -> web.Response:
        try:
            req = await request.json()
        except ValueError:
            raise APIError(400, "the body is not valid JSON") from None
        if not isinstance(req, dict):
            raise APIError(400, "the body must be a JSON object")
        for name in ("input_file_id", "endpoint"):
            if not isinstance(req.get(name), str):
                raise APIError(400, f"{name} is required", param=name)
        window, alias = req.get("completion_window"), req.get("completeWithin")
        if window is None:
            window = alias
        if window is None:
            raise APIError(400, "completion_window is required", param="completion_window")
        if alias is not None and parse_window(alias, "completeWithin") != parse_window(window):
            raise APIError(400, "completion_window and completeWithin disagree",
                           param="completeWithin")
        batch = self.store.create_batch(req["input_file_id"], req["endpoint"], window,
                                        _metadata(req.get("metadata")), self.models,
                                        owner(request))
        return json_response(batch_object(batch, time.time()))

    async def list_batches(self, request: web.Request) -> web.Response:
        limit = _limit(request, 20, 100)
        batches = self.store.list_batches(request.query.get("after"), limit + 1,
                                          owner(request))
        now = time.time()
        return json_response(_page([batch_object(b, now) for b in batches], limit))

    async def get(self, request: web.Request) -> web.Response:
        batch_id = request.match_info["batch_id"]
        batch = self.store.get_batch(batch_id, owner(request))
        if batch is None:
            raise APIError(404, f"no batch {batch_id!r}", param="batch_id")
        return json_response(batch_object(batch, time.time()))

    async def cancel(self, request: web.Request) -> web.Response:
        batch = self.runner.cancel(request.match_info["batch_id"], owner(request))
        return json_response(batch_object(batch, time.time()))

    def _file(self, request: web.Request) -> StoredFile:
        file_id = request.match_info["file_id"]
        file = self.store.get_file(file_id, owner(request))
        if file is None:
            raise APIError(404, f"no file {file_id!r}", param="file_id")
        return file


async def _read_file(part: BodyPartReader) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(1 << 16):
        size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise APIError(413, f"the file is over {MAX_FILE_BYTES >> 20} MiB", param="file")
        chunks.append(chunk)
    return b"".join(chunks)


def _metadata(raw: object) -> dict | None:
    """OpenAI's metadata: up to 16 string pairs, keys to 64 characters, values to 512."""
    if raw is None:
        return None
    if (not isinstance(raw, dict) or len(raw) > MAX_METADATA_KEYS
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                       and len(v) <= 512 for k, v in raw.items())):
        raise APIError(400, "metadata must map up to 16 keys (64 characters at most) to "
                       "strings (512 characters at most)", param="metadata")
    return raw
