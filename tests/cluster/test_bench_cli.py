"""`baton bench` and `baton bench sweep` end to end against the fake server: result files with
vLLM's keys, exact token-id prompts, the knee of a server that saturates, clean errors."""

from __future__ import annotations

import json
import socket

import pytest
from baton_serve.cluster.bench.fakeserver import FakeOpenAIServer, FakeServerConfig
from baton_serve.cluster.cli import main

VLLM_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
             "request_goodput", "total_input_tokens", "total_output_tokens", "input_lens", "output_lens", "ttfts",
             "itls", "errors") + tuple(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
                                       for m in ("ttft", "tpot", "itl", "e2el"))


@pytest.fixture
def tokenizer_dir(tmp_path):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["<unk>"] + "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<unk>", special=True)])
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _bench(url: str, *extra: str) -> int:
    return main(["bench", "--base-url", url, "--disable-tqdm", "--request-timeout", "30", *extra])


def test_run_writes_json_markdown_and_plot_with_exact_token_prompts(tmp_path, tokenizer_dir, capsys):
    out = tmp_path / "res" / "run.json"
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.1, itl_s=0.02)) as server:
        rc = _bench(server.url, "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "3",
                    "--request-rate", "50", "--goodput", "ttft:500", "tpot:100", "--tokenizer", str(tokenizer_dir),
                    "--result-file", str(out))
        bodies = server.bodies
    assert rc == 0
    data = json.loads(out.read_text())
    assert all(k in data for k in VLLM_KEYS), [k for k in VLLM_KEYS if k not in data]
    assert data["completed"] == 6 and data["model_id"] == "fake-model" and data["prompt_lengths"] == "exact"
    assert data["slo_attainment"] == 1.0 and data["cold_request"]["ok"] is True
    assert data["input_lens"] == [12] * 6 and data["output_lens"] == [3] * 6
    measured = bodies[1:]  # the first is the warm-up
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 12 for b in measured)
    assert all(b["max_tokens"] == 3 and b["ignore_eos"] for b in measured)
    md = out.with_suffix(".md").read_text()
    assert "| TTFT |" in md and "goodput" in md
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| TTFT |" in capsys.readouterr().out
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.05, itl_s=0.01)) as server:
        rc = _bench(server.url, "--num-prompts", "2", "--random-input-len", "12", "--random-output-len", "2",
                    "--num-warmups", "0", "--tokenizer", str(tokenizer_dir), "--text-prompts")
        texts = [b["prompt"] for b in server.bodies]
    from baton_serve.workers.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tokenizer_dir)
    assert rc == 0 and all(isinstance(t, str) and len(tok.encode(t)) == 12 for t in texts)


def test_chat_shared_prefix_without_a_tokenizer_says_lengths_are_approximate(tmp_path, capsys):
    out = tmp_path / "chat.json"
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.05, itl_s=0.01)) as server:
        rc = _bench(server.url, "--endpoint", "/v1/chat/completions", "--dataset-name", "shared-prefix",
                    "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-prefix-len", "8",
                    "--prefix-repetition-suffix-len", "4", "--prefix-repetition-output-len", "2",
                    "--num-prompts", "4", "--max-concurrency", "2", "--num-warmups", "0", "--no-plot",
                    "--result-file", str(out))
        bodies = server.bodies
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["prompt_lengths"] == "approximate" and data["mode"].startswith("closed loop")
    assert any("approximate" in w for w in data["warnings"])
    assert all([m["role"] for m in b["messages"]] == ["system", "user"] for b in bodies)
    assert len({b["messages"][0]["content"] for b in bodies}) == 2  # two shared system prompts
    assert not out.with_suffix(".png").exists()
    assert "approximate" in capsys.readouterr().err


def test_sweep_finds_the_knee_of_a_saturating_server(tmp_path, capsys):
    # One stream at a time, 100 ms each: fine at 4 req/s, queueing far past the SLO at 40 req/s.
    out = tmp_path / "sweep.json"
    server_cfg = FakeServerConfig(ttft_s=0.05, itl_s=0.025, capacity=1)
    with FakeOpenAIServer(server_cfg) as server:
        rc = main(["bench", "sweep", "--base-url", server.url, "--rates", "40,4", "inf", "--num-prompts", "10",
                   "--burstiness", "inf", "--random-input-len", "8", "--random-output-len", "3",
                   "--goodput", "ttft:300", "tpot:100", "--result-file", str(out), "--disable-tqdm"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["rates"] == [4.0, 40.0, "inf"]
    assert [p["meets_slo"] for p in data["points"]] == [True, False, False]
    assert data["knee_request_rate"] == 4.0
    assert data["points"][0]["p99_ttft_ms"] < 300 < data["points"][1]["p99_ttft_ms"]
    assert "knee" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "**4 req/s**" in capsys.readouterr().out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    ([], "cannot list models"),
    (["sweep", "--rates", "1"], "needs SLOs"),
    (["--rates", "1", "2"], "--rates is for"),
    (["--goodput", "ttft:10", "sweep"], "right after 'bench'"),
    (["--goodput", "speed:3"], "--goodput"),
    (["--dataset-name", "trace", "--dataset-path", "/nonexistent/trace.jsonl", "--model", "m"], "cannot read trace"),
])
def test_errors_are_one_line_and_exit_2(args, message, capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    args = args[:1] + ["--base-url", url] + args[1:] if args[:1] == ["sweep"] else ["--base-url", url, *args]
    assert main(["bench", "--disable-tqdm", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
