"""Admission through real HTTP on Ray workers: keys, rates, KV reservations (admit, queue, deadline,
degrade, reject), usage records, idempotent retries, tenant isolation."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from baton_serve.cluster.admission.tenants import hash_key
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.serve import Deployment
from baton_serve.cluster.usage.sqlite_store import SQLiteUsageStore

KEYS = {"a": "sk-a", "b": "sk-b", "rate": "sk-rate", "flex": "sk-flex", "chaos": "sk-chaos", "flood": "sk-flood",
        "admin": "sk-admin"}
NUM_BLOCKS, BLOCK = 64, 8


@dataclass
class Served:
    dep: Deployment
    url: str
    usage_path: Path

    def records(self) -> list:
        self.dep.front.admission.usage.flush()
        return self.dep.front.admission.usage.records()


def _tenants(path: Path) -> Path:
    t = path / "tenants.toml"
    t.write_text(f"""
[tenants.a]
api_keys = ["{hash_key(KEYS['a'])}"]
[tenants.b]
api_keys = ["{hash_key(KEYS['b'])}"]
[tenants.rate]
api_keys = ["{hash_key(KEYS['rate'])}"]
requests_per_second = 0.2
request_burst = 2
[tenants.flex]
api_keys = ["{hash_key(KEYS['flex'])}"]
allow_degrade = true
[tenants.flood]
api_keys = ["{hash_key(KEYS['flood'])}"]
requests_per_second = 1
request_burst = 2
[tenants.chaos]
api_keys = ["{hash_key(KEYS['chaos'])}"]
[admin]
api_keys = ["{hash_key(KEYS['admin'])}"]
""")
    return t


@pytest.fixture(scope="module")
def served(ray_session, tiny_model_dir, tmp_path_factory):
    from baton_serve.router.server import ServerThread

    d = tmp_path_factory.mktemp("admission")
    config = ClusterConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "block_size": BLOCK, "num_kv_blocks": NUM_BLOCKS},
        "pools": {"colocated": 1},
        "server": {"model_name": "tiny", "tenants": str(_tenants(d)), "protect_metrics": True,
                   "idempotency_grace_s": 2.0},
        "admission": {"queue_timeout_s": 3.0, "max_queued_per_class": 2},
        "usage": {"path": str(d / "usage.sqlite3")},
    })
    dep = Deployment(config).start()
    server = ServerThread(dep.app).start()
    try:
        yield Served(dep, server.url, d / "usage.sqlite3")
    finally:
        server.stop()
        dep.stop()


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def _body(max_tokens: int = 8, stream: bool = False, prompt: str = "Hello there", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, **extra}


def _post(url: str, tenant: str | None, body: dict, timeout: float = 60, **headers) -> httpx.Response:
    h = {**(_auth(tenant) if tenant else {}), **headers}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=h, timeout=timeout)


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err


class Held:
    """Blocks held in the front's ledger as a long request would hold them (a stream the client
    stops reading does not: loopback buffers take all of a tiny model's output at once)."""

    def __init__(self, served: Served, blocks: int) -> None:
        from baton_serve.cluster.admission.kv import KVDemand
        from baton_serve.cluster.admission.tenants import Tenant

        self.kv, self.loop = served.dep.pool.admission, served.dep.front.loop
        worker = next(iter(self.kv.ledgers))
        demand = KVDemand("held-by-test", Tenant("a"), blocks * BLOCK - 1, 1, 1, 0)
        asyncio.run_coroutine_threadsafe(self.kv.reserve(demand, lambda: [worker], lambda: worker),
                                         self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.kv.release, "held-by-test")


def _wait_free(served: Served, timeout_s: float = 20.0) -> None:
    """Until this front's ledgers hold nothing (every request released its reservation)."""
    deadline = time.monotonic() + timeout_s
    ledgers = served.dep.front.admission.kv.ledgers.values()
    while any(lg.reserved_blocks for lg in ledgers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(lg.reserved_blocks for lg in ledgers)


def test_the_front_reads_workers_output_sockets_with_the_deployment_secret(served):
    pool = served.dep.pool
    assert all(w.info["output_secret"] for w in pool.workers.values())
    assert len(pool.links._writers) == len(pool.workers)  # connected, not fallen back to polling over Ray


def test_keys_401_and_admin_only_metrics(served):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = httpx.post(f"{served.url}/v1/chat/completions", json=_body(), headers=headers)
        assert r.status_code == 401 and _error(r)["type"] == "authentication_error"
    assert _post(served.url, "a", _body()).status_code == 200
    assert httpx.get(f"{served.url}/metrics").status_code == 401
    assert httpx.get(f"{served.url}/metrics", headers=_auth("a")).status_code == 401  # a tenant, not admin
    metrics = httpx.get(f"{served.url}/metrics", headers=_auth("admin"))
    assert metrics.status_code == 200
    assert 'baton:requests_rejected_total{model_name="tiny",reason="unauthenticated",tenant=""} 2.0' in metrics.text
    assert httpx.get(f"{served.url}/health").status_code == 200  # probes stay open by default


def test_request_rate_429_with_retry_after(served):
    codes = [_post(served.url, "rate", _body(max_tokens=2)).status_code for _ in range(2)]
    r = _post(served.url, "rate", _body(max_tokens=2))
    assert codes == [200, 200] and r.status_code == 429
    assert _error(r)["code"] == "tenant_request_rate" and int(r.headers["Retry-After"]) >= 1
    assert _post(served.url, "b", _body(max_tokens=2)).status_code == 200  # b is not a's bucket


def test_a_flood_from_one_tenant_is_refused_at_its_rate_and_harms_no_one_else(served):
    """Timing (B's TTFT alone and under the flood) is benchmarks/admission.py's; this pins who gets what."""
    with ThreadPoolExecutor(8) as pool:
        flood = [pool.submit(_post, served.url, "flood", _body(max_tokens=4)) for _ in range(24)]
        others = [pool.submit(_post, served.url, "b", _body(max_tokens=4)) for _ in range(6)]
        flood_codes = [f.result().status_code for f in flood]
        other_codes = [f.result().status_code for f in others]
    assert other_codes == [200] * 6
    assert 2 <= flood_codes.count(200) <= 6 and flood_codes.count(429) >= 18  # burst 2, then 1/s
    assert set(flood_codes) == {200, 429}
    _wait_free(served)


def test_queue_then_admit(served):
    # Each needs ceil((prompt + 200) / 8) = 27 of 64 blocks: two fit, the third waits for one to end.
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda _: _post(served.url, "a", _body(max_tokens=200)), range(3)))
    assert [r.status_code for r in replies] == [200] * 3
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in replies)
    ids = {r.json()["id"] for r in replies}
    queued = [rec.queue_time_s for rec in served.records() if rec.request_id in ids]
    assert len(queued) == 3 and sum(q > 0 for q in queued) >= 1
    _wait_free(served)


def test_queue_deadline_and_queue_full_reject(served):
    held = Held(served, 52)  # 52 of 64 blocks until it is closed
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(_post, served.url, "b", _body(max_tokens=200)) for _ in range(2)]
            time.sleep(0.5)
            full = _post(served.url, "b", _body(max_tokens=200))
            assert full.status_code == 429 and _error(full)["code"] == "kv_queue_full"
            assert int(full.headers["Retry-After"]) >= 1
            late = [f.result() for f in waiting]
        for r in late:  # queued past the 3 s deadline while the held stream kept its blocks
            assert r.status_code == 429 and _error(r)["code"] == "queue_deadline" and "Retry-After" in r.headers
    finally:
        held.close()
    _wait_free(served)
    assert _post(served.url, "b", _body(max_tokens=200)).status_code == 200


def test_degrade_caps_max_tokens_for_a_tenant_that_allows_it(served):
    held = Held(served, 52)
    try:
        r = _post(served.url, "flex", _body(max_tokens=300))
        assert r.status_code == 200, r.text
        cap = int(r.headers["X-Baton-Degraded"].removeprefix("max_tokens="))
        assert 16 <= cap < 300
        assert r.json()["usage"]["completion_tokens"] == cap
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        held.close()
    _wait_free(served)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_degrade_runs_fewer_samples_of_n_for_a_tenant_that_allows_it(served, stream):
    from baton_serve.cluster.admission.kv import KVDemand
    from baton_serve.cluster.admission.tenants import Tenant

    prompt_tokens = _post(served.url, "flex", _body(max_tokens=1)).json()["usage"]["prompt_tokens"]
    kv = served.dep.pool.admission
    room = kv.blocks_for(KVDemand("probe", Tenant("flex"), prompt_tokens, 32, 2, 0))  # two whole samples
    held = Held(served, NUM_BLOCKS - room)
    try:
        r = _post(served.url, "flex", _body(max_tokens=32, n=4, stream=stream))
        assert r.status_code == 200, r.text
        assert r.headers["X-Baton-Degraded"] == "n=2"
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            finished = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
            assert finished == {0: "length", 1: "length"}
        else:
            body = r.json()
            assert [c["index"] for c in body["choices"]] == [0, 1]
            assert body["usage"]["completion_tokens"] == 2 * 32
    finally:
        held.close()
    _wait_free(served)


def test_tenants_never_see_each_others_cache(served):
    prompt = "a shared system prompt that spans several blocks of the cache, " * 3
    first = _post(served.url, "a", _body(max_tokens=2, prompt=prompt)).json()["usage"]
    again = _post(served.url, "a", _body(max_tokens=2, prompt=prompt)).json()["usage"]
    other = _post(served.url, "b", _body(max_tokens=2, prompt=prompt)).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] >= BLOCK
    assert other["prompt_tokens_details"]["cached_tokens"] == 0


def test_idempotent_retries_generate_once(served):
    body = _body(max_tokens=24)
    key = {"Idempotency-Key": "order-42"}
    with ThreadPoolExecutor(2) as pool:
        pair = list(pool.map(lambda _: _post(served.url, "a", body, **key), range(2)))
    after = _post(served.url, "a", body, **key)
    bodies = [r.json() for r in (*pair, after)]
    assert all(r.status_code == 200 for r in (*pair, after))
    assert bodies[0] == bodies[1] == bodies[2]  # one response, the same id and tokens for every retry
    records = [rec for rec in served.records() if rec.idempotency_key == "order-42"]
    generated = [rec for rec in records if rec.finish_reason != "replayed"]
    assert len(generated) == 1 and generated[0].completion_tokens == 24
    assert sum(rec.completion_tokens for rec in records) == 24  # billed once
    # Another tenant's same key is another run; a different body under the key is a 422.
    assert _post(served.url, "b", body, **key).json()["id"] != bodies[0]["id"]
    r = _post(served.url, "a", _body(max_tokens=25), **key)
    assert r.status_code == 422 and _error(r)["code"] == "idempotency_key_reused"


def test_idempotent_stream_resumes_after_last_event_id(served):
    body = _body(max_tokens=12, stream=True, stream_options={"include_usage": True})
    key = {"Idempotency-Key": "stream-7"}

    def events(headers: dict[str, str]) -> list[tuple[int, str]]:
        out, ident = [], None
        with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body,
                          headers={**_auth("a"), **key, **headers}, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("id: "):
                    ident = int(line[4:])
                elif line.startswith("data: "):
                    out.append((ident, line[6:]))
        return out

    whole = events({})
    assert whole[-1][1] == "[DONE]" and [i for i, _ in whole] == list(range(len(whole)))
    resumed = events({"Last-Event-ID": "3"})
    assert resumed == whole[4:]
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                   for _, d in whole[:-1] if json.loads(d)["choices"])
    assert text  # the tokens came once, and the replay carried them verbatim


def test_every_request_has_exactly_one_usage_record_and_they_survive_a_reopen(served):
    before = {rec.request_id for rec in served.records()}
    outcomes = []
    for i in range(12):
        mode = i % 3
        if mode == 0:
            outcomes.append(_post(served.url, "b", _body(max_tokens=4)).status_code)
        elif mode == 1:  # the client disconnects mid-stream
            with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=_body(200, stream=True),
                              headers=_auth("b"), timeout=60) as r:
                next(r.iter_lines())
            outcomes.append(499)
        else:  # a timeout far shorter than the generation
            try:
                _post(served.url, "b", _body(max_tokens=400), timeout=0.2)
                outcomes.append(200)
            except httpx.TimeoutException:
                outcomes.append(499)
    _wait_free(served)
    deadline = time.monotonic() + 10
    while len({r.request_id for r in served.records()} - before) < 12 and time.monotonic() < deadline:
        time.sleep(0.1)
    new = [rec for rec in served.records() if rec.request_id not in before]
    assert len(new) == 12 and served.dep.front.admission.usage.duplicates == 0
    assert sorted(r.finish_reason for r in new).count("length") == outcomes.count(200)
    assert all(rec.tenant == "b" and rec.model == "tiny" and rec.weights_fingerprint for rec in new)
    reopened = SQLiteUsageStore(served.usage_path)
    try:
        assert {r.request_id for r in reopened.records()} >= {r.request_id for r in new}
    finally:
        reopened.close()


def test_bad_input_refused_and_nothing_leaks(served):
    r = httpx.post(f"{served.url}/v1/chat/completions", content=b"{not json", headers=_auth("a"))
    assert r.status_code == 400
    r = httpx.post(f"{served.url}/v1/chat/completions", content=b"x" * (5 << 20), headers=_auth("a"))
    assert r.status_code == 413
    assert _post(served.url, "a", _body(max_tokens=100_000)).status_code == 400
    _wait_free(served)
    assert served.dep.front.admission.gate.in_flight == 0
    assert all(w.alive for w in served.dep.pool.workers.values())
    assert _post(served.url, "a", _body(max_tokens=2)).status_code == 200


def test_a_thousand_requests_with_random_cancels_end_in_one_consistent_record_each(served):
    """Finish, client cancel, client timeout and disconnect mid-stream at random moments: exactly one
    record each, and every response a client saw whole matches its record."""
    import asyncio
    import random

    rng = random.Random(7)
    plans = [(rng.choice(["whole", "stream", "disconnect", "timeout", "cancel"]), rng.randint(1, 8),
              rng.uniform(0.0, 0.05)) for _ in range(1000)]
    seen: dict[str, tuple[int, str]] = {}  # response id -> (completion tokens, finish reason) as seen
    refused: list[httpx.Response] = []

    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, plan: tuple[str, int, float]) -> None:
        mode, max_tokens, delay = plan
        async with gate:
            body = _body(max_tokens=max_tokens, stream=mode != "whole",
                         **({"stream_options": {"include_usage": True}} if mode != "whole" else {}))
            url = f"{served.url}/v1/chat/completions"
            if mode == "whole":
                r = await client.post(url, json=body, headers=_auth("chaos"))
                if r.status_code != 200:  # KV queue full: a refusal is an outcome too, and has its record
                    assert r.status_code == 429 and _error(r)["code"], r.text
                    refused.append(r)
                    return
                j = r.json()
                seen[j["id"]] = (j["usage"]["completion_tokens"], j["choices"][0]["finish_reason"])
                return
            if mode in ("timeout", "cancel"):
                # Give up at a random moment: a timeout on a whole response, a cancel of a stream. A
                # request given up before its bytes left is no request of the server's: the count of
                # records is checked against the requests the gate saw, and those are nearly all.
                work = asyncio.ensure_future(client.post(
                    url, json=_body(max_tokens=24, stream=mode == "cancel"), headers=_auth("chaos")))
                await asyncio.sleep(delay * 4)
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await work
                return
            async with client.stream("POST", url, json=body, headers=_auth("chaos")) as r:
                if r.status_code != 200:
                    refused.append(r)
                    return
                finish, rid, usage = None, None, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    rid = chunk["id"]
                    if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                        finish = chunk["choices"][0]["finish_reason"]
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
                    if mode == "disconnect":
                        return  # leaves after its first chunk
                seen[rid] = (usage, finish)

    async def run() -> None:
        gate = asyncio.Semaphore(8)
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.wait_for(asyncio.gather(*(one(client, gate, p) for p in plans)), 240)

    import contextlib

    before = {rec.request_id for rec in served.records()}
    arrived = served.dep.front.admission.gate.arrivals("chaos")
    asyncio.run(run())
    arrived = served.dep.front.admission.gate.arrivals("chaos") - arrived
    _wait_free(served)
    deadline = time.monotonic() + 20
    while served.dep.front.admission.gate.in_flight and time.monotonic() < deadline:
        time.sleep(0.1)
    records = [r for r in served.records() if r.request_id not in before and r.tenant == "chaos"]
    assert 950 <= arrived <= 1000
    assert len(records) == arrived and len({r.request_id for r in records}) == arrived
    assert served.dep.front.admission.usage.duplicates == 0
    by_id = {r.request_id: r for r in records}
    for rid, (tokens, finish) in seen.items():
        assert (by_id[rid].completion_tokens, by_id[rid].finish_reason) == (tokens, finish), rid
    assert sum(r.status == 429 for r in records) >= len(refused)
    assert len(seen) >= 300  # the whole and fully read ones: a good share of the thousand
    assert all(w.alive for w in served.dep.pool.workers.values())
