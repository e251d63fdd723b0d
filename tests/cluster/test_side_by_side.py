"""The side-by-side benchmark's pieces: the plain-transformers server (streamed completions equal
``generate``, exact usage, static batches that match single runs), server start/stop, and the
ratio table."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from benchmarks.hf_server import GenRequest, create_app, run_batch
from benchmarks.side_by_side import (
    ServerProcess,
    SystemResult,
    SystemSpec,
    WorkloadResult,
    alive,
    bench_configs,
    compute_ratios,
    descendants,
    markdown,
    merge_rounds,
    parse_args,
    round_order,
    run_workload,
)

PROMPT = "The quick brown fox jumps over"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def hf_url(tiny_model_dir: Path):
    import uvicorn

    app = create_app(tiny_model_dir, dtype="float32", max_batch=8, batch_wait_ms=50)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "hf_server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def hf_ref(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return tok, model


def _generate(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_streamed_greedy_completion_equals_generate_with_usage(hf_url, hf_ref, tiny_model_dir):
    from openai import OpenAI

    tok, model = hf_ref
    client = OpenAI(base_url=hf_url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [tiny_model_dir.name]
    ids = tok(PROMPT)["input_ids"]
    expected = _generate(model, ids, 10)
    stream = client.completions.create(model=tiny_model_dir.name, prompt=PROMPT, max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tok.decode(expected, skip_special_tokens=True)
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == len(expected)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length" if len(expected) == 10 else "stop"]
    # token ids in, ignore_eos: exactly max_tokens out, non-streamed.
    resp = httpx.post(hf_url + "/v1/completions", json={"prompt": ids, "max_tokens": 7, "temperature": 0,
                                                        "ignore_eos": True}, timeout=30).json()
    assert resp["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 7, "total_tokens": len(ids) + 7}
    assert resp["choices"][0]["finish_reason"] == "length"
    bad = httpx.post(hf_url + "/v1/completions", json={"prompt": [], "max_tokens": 3}, timeout=30)
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]


def test_static_batch_of_uneven_prompts_matches_single_runs(hf_ref):
    tok, model = hf_ref
    prompts = [tok(p)["input_ids"] for p in (PROMPT, "Hello world! How are you today? I am fine", "Paris")]
    reqs = [GenRequest(ids, max_tokens=n) for ids, n in zip(prompts, (6, 9, 4))]
    got: dict[int, list[int]] = {i: [] for i in range(len(reqs))}

    def emit(events) -> None:
        for req, token, _ in events:
            got[reqs.index(req)].append(token)

    run_batch(model, reqs, pad_id=0, eos_ids={2}, emit=emit)
    for i, (ids, req) in enumerate(zip(prompts, reqs)):
        assert got[i] == _generate(model, ids, req.max_tokens), f"row {i}"


def test_server_process_waits_for_models_and_stops_its_group(tmp_path):
    port = _free_port()
    spec = SystemSpec("fake", [sys.executable, "-m", "baton_serve.cluster.bench.fakeserver", "--port", str(port),
                               "--ttft-ms", "5", "--itl-ms", "2"])
    with ServerProcess(spec, port, tmp_path / "fake.log", drain_s=5) as server:
        assert server.wait_ready(30) < 30
        args = parse_args(["--num-prompts", "3", "--rate-prompts", "2", "--rate", "20", "--random-input-len", "8",
                           "--random-output-len", "4"])
        cfgs = bench_configs(args, f"http://127.0.0.1:{port}", "fake-model")
        sat = run_workload(cfgs["saturation"], timeout_s=30)
        pid = server.proc.pid
    assert sat.summary["completed"] == 3 and sat.summary["output_throughput"] > 0 and not sat.error
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    dead = SystemSpec("dead", [sys.executable, "-c", "raise SystemExit(3)"])
    with ServerProcess(dead, _free_port(), tmp_path / "dead.log") as server:
        with pytest.raises(RuntimeError, match="exited with code 3"):
            server.wait_ready(10)


def test_stop_kills_a_descendant_that_left_the_group(tmp_path):
    # Like a Ray worker: a child in its own session that ignores SIGINT/SIGTERM sent to the group.
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
            "start_new_session=True); time.sleep(120)")
    server = ServerProcess(SystemSpec("tree", [sys.executable, "-c", code]), 0, tmp_path / "tree.log", drain_s=1)
    server.__enter__()
    deadline = time.monotonic() + 10
    while not descendants(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = descendants(server.proc.pid)
    assert server.stop() == 1
    time.sleep(0.2)
    assert not alive(child)


def _res(name: str, tps: float, tpot: float, status: str = "ok", single: tuple[float, float] | None = None
         ) -> SystemResult:
    sat = WorkloadResult({"completed": 8, "failed": 0, "output_throughput": tps, "p99_tpot_ms": 99.0}, "", [])
    rate = WorkloadResult({"completed": 4, "failed": 1, "output_throughput": 1.0, "p99_tpot_ms": tpot}, "", [])
    one = None if single is None else WorkloadResult(
        {"completed": 8, "failed": 0, "median_ttft_ms": single[0], "median_tpot_ms": single[1]}, "", [])
    return SystemResult(name, status, saturation=sat, rate=rate, single=one, startup_s=3.0)


def test_ratios_and_table():
    results = [_res("baton-colocated", 400.0, 40.0), _res("baton-disagg", 300.0, 60.0), _res("hf", 100.0, 80.0),
               _res("vllm", 180.0, 50.0), SystemResult("gone", "not installed", "no venv")]
    ratios = {(q.baton, q.peer): q for q in compute_ratios(results)}
    assert set(ratios) == {(b, p) for b in ("baton-colocated", "baton-disagg") for p in ("hf", "vllm")}
    q = ratios["baton-colocated", "vllm"]
    assert q.output_throughput_ratio == pytest.approx(400 / 180) and q.p99_tpot_ratio == pytest.approx(0.8)
    assert q.meets_target is True
    assert ratios["baton-disagg", "vllm"].meets_target is False  # 1.67x tok/s, 1.2x TPOT
    assert ratios["baton-colocated", "hf"].output_throughput_ratio == pytest.approx(4.0)
    assert ratios["baton-colocated", "hf"].meets_target is None  # no target against HF
    md = markdown(results, list(ratios.values()), 1.0)
    assert "| baton-colocated | ok | 3.0 | 400.0 |" in md
    assert "| gone | not installed: no venv |" in md
    assert "| baton-colocated / vllm | 2.22 | 0.80 | - | - | met |" in md
    # The single-stream workload: TTFT of a prompt alone and one stream's TPOT, Baton over peer.
    one = {(q.baton, q.peer): q for q in compute_ratios([_res("baton-int4", 90.0, 30.0, single=(200.0, 12.0)),
                                                          _res("llamacpp", 30.0, 50.0, single=(400.0, 15.0))])}
    q = one["baton-int4", "llamacpp"]
    assert q.single_ttft_ratio == pytest.approx(0.5) and q.single_tpot_ratio == pytest.approx(0.8)
    assert q.meets_target is None  # targets are against vLLM
    # A peer that failed, or ran no workload, yields no ratio rather than a wrong one.
    failed = compute_ratios([_res("baton-colocated", 400.0, 40.0), SystemResult("vllm", "failed", "boom")])
    assert failed[0].output_throughput_ratio is None and failed[0].meets_target is None


def test_rounds_merge_to_each_figures_median_and_keep_every_round():
    runs = [_res("baton-colocated", tps, tpot, single=(ttft, 15.0))
            for tps, tpot, ttft in ((400.0, 40.0, 120.0), (460.0, 30.0, 180.0), (420.0, 50.0, 110.0))]
    merged = merge_rounds(runs)
    assert merged.status == "ok" and merged.startup_s == 3.0
    assert merged.saturation.summary["output_throughput"] == 420.0 and merged.saturation.summary["rounds"] == 3
    assert merged.rate.summary["p99_tpot_ms"] == 40.0 and merged.single.summary["median_ttft_ms"] == 120.0
    assert [r["saturation.output_throughput"] for r in merged.rounds] == [400.0, 460.0, 420.0]
    ratio = compute_ratios([merged, merge_rounds([_res("vllm", 200.0, 40.0), _res("vllm", 210.0, 44.0)])])[0]
    assert ratio.output_throughput_ratio == pytest.approx(420.0 / 205.0)
    # a round that failed fails the system, with that round's reason
    broken = merge_rounds([runs[0], SystemResult("baton-colocated", "failed", "exited with code 1")])
    assert broken.status == "failed" and broken.detail == "exited with code 1"
    assert merge_rounds(runs[:1]) is runs[0]


def test_rounds_alternate_their_order():
    names = ["baton-colocated", "vllm", "hf"]
    assert [round_order(names, r) for r in range(3)] == [names, names[::-1], names]


def test_baton_gets_the_kv_budget_vllm_gets():
    from benchmarks.side_by_side import build_specs, parse_args

    args = parse_args(["--vllm-kvcache-gib", "3", "--vllm-venv", "/nonexistent"])
    for name in ("baton-colocated", "baton-disagg"):
        argv = build_specs(args, "/m", 8123, name).argv
        assert argv[argv.index("--kv-cache-memory-gib") + 1] == "3"
    # and the flag is one baton serve takes
    from baton_serve.cluster.cli import build_parser

    assert build_parser().parse_args(["serve", "--kv-cache-memory-gib", "3"]).kv_cache_memory_gib == 3.0
