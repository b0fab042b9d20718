"""Who may use the gateway's own routes (the Batch API): whoever a replica would serve.

The replicas hold the API keys (`--api-key`, `--api-keys-file`); the gateway keeps none.
For a route it answers itself, it shows the caller's Authorization header to a replica
(`GET /v1/models`, which any valid key may read) and passes a 401 on. A key found valid
is remembered for a minute, so a client polling its batch costs the replicas nothing.
Replicas without keys accept anyone, and so does the gateway then.
"""

import time

import aiohttp

from gateway.replicas import Replica
from server.protocol import APIError

VALID_FOR_S = 60.0


class KeyCheck:
    def __init__(self, replicas: list[Replica], session: aiohttp.ClientSession):
        self.replicas = replicas
        self.session = session
        self.valid: dict[str, float] = {}  # Authorization header -> valid until (monotonic)

    async def check(self, authorization: str) -> None:
        """Return if a replica accepts `authorization` ("" when none was sent); else raise
        its 401 (503 when no replica is up to ask)."""
        now = time.monotonic()
        if self.valid.get(authorization, 0.0) > now:
            return
        replica = next((r for r in self.replicas if r.up), None)
        if replica is None:
            raise APIError(503, "no replica is up to check the API key",
                           headers={"Retry-After": "1"})
        headers = {"Authorization": authorization} if authorization else {}
        try:
            async with self.session.get(replica.url + "/v1/models", headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=5)) as r:
                status = r.status
        except (aiohttp.ClientError, TimeoutError):
            raise APIError(503, "the replica asked about the API key did not answer",
                           headers={"Retry-After": "1"}) from None
        if status == 401:
            raise APIError(401, "missing or invalid API key", code="invalid_api_key")
        if status != 200:
            raise APIError(503, f"the replica asked about the API key answered {status}",
                           headers={"Retry-After": "1"})
        if len(self.valid) > 1024:  # forget the expired ones now and then
            self.valid = {k: t for k, t in self.valid.items() if t > now}
        self.valid[authorization] = now + VALID_FOR_S
