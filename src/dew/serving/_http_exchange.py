"""How one HTTP exchange with an engine server is tried, and how its faults are named.

:class:`~dew.serving._http_base.LoopEngine` picks the pool and the time budget; these
two functions hold the retry rules and turn the transport's faults
(:mod:`dew.serving._http_client`) into the engine's: :class:`~dew.core.EngineError`
naming the URL and path, or ``ValueError`` for a request the server refused (4xx).

* :func:`exchange`: a JSON request. A connection never made is tried again (nothing was
  sent); with ``retry`` (requests safe to repeat) so are a broken connection and a 5xx;
  a timeout never is, since it already waited its whole budget.
* :func:`read_ok`: a read that changes nothing (a timings or metrics scrape), due whole
  within its budget, tried a second time only when a kept-alive connection broke under
  it.

Both run on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from dew.core import EngineError
from dew.serving._http_client import Broken, NotConnected, Pool, Response, TimedOut

__all__ = ["exchange", "read_ok"]

_BACKOFF = (0.05, 0.2, 0.5)  # delays between the tries of a request safe to retry


async def exchange(
    pool: Pool,
    method: str,
    path: str,
    body: Any,
    *,
    timeout: float,
    retry: bool = False,
    many: bool = False,
) -> Any:
    """One exchange; the JSON object a 200 answers (``{}`` for an empty body).
    ``ValueError`` for a 4xx (the server's message), :class:`EngineError` for a transport
    fault, a timeout, a 5xx or a malformed answer (see the module docstring for what is
    tried again). ``many``: the answer is a JSON array (a batch's)."""
    where = f"{pool.url}{path}"
    payload = None if body is None else json.dumps(body).encode()
    for delay in (*_BACKOFF, None):
        try:
            response = await pool.request(method, path, payload, timeout=timeout)
        except NotConnected as exc:
            fault = EngineError(f"{where}: {exc}")
        except TimedOut as exc:
            raise EngineError(f"{where}: no answer in time: {exc}") from None
        except Broken as exc:
            fault = EngineError(f"{where}: {exc}")
            if not retry:
                raise fault from None
        else:
            status, data = response.status, response.json()
            if 400 <= status < 500:
                raise ValueError(f"{where}: {status}: {response.error_message()}")
            if status == 200:
                if not response.body:
                    return {}
                if not isinstance(data, list if many else dict):
                    kind = "array" if many else "object"
                    raise EngineError(f"{where}: the answer is not a JSON {kind}")
                return data
            fault = EngineError(f"{where}: {status}: {response.error_message()}")
            if not retry:
                raise fault
        if delay is None:
            raise fault
        await asyncio.sleep(delay)
    raise AssertionError("unreachable")


async def read_ok(pool: Pool, path: str, budget: float) -> Response:
    """``GET path`` answered 200, all of it within ``budget`` seconds (see the module
    docstring); a server that cannot be reached, answers late or answers anything but
    200 raises :class:`EngineError` naming the URL at once."""
    where = f"{pool.url}{path}"
    clock = asyncio.get_running_loop().time
    deadline = clock() + budget
    for last in (False, True):
        left = deadline - clock()
        if left <= 0:
            break
        try:
            response = await pool.request("GET", path, None, timeout=left)
        except NotConnected as exc:
            raise EngineError(f"{where}: {exc}") from None
        except TimedOut:
            break
        except Broken as exc:
            if last:
                raise EngineError(f"{where}: {exc}") from None
            continue
        if response.status != 200:
            message = " ".join(response.error_message().split())[:300]
            raise EngineError(f"{where}: {response.status}: {message}")
        return response
    raise EngineError(f"{where}: no answer within {budget:g}s")
