"""`baton bench --warmup-prefixes`: each system prompt of a shared-prefix workload is sent once,
with a fresh suffix, before the measured requests, which are the very same as without it."""

from __future__ import annotations

import json

from baton_serve.cluster.bench.fakeserver import FakeOpenAIServer, FakeServerConfig
from baton_serve.cluster.bench.prompts import PromptFactory
from baton_serve.cluster.bench.workload import LengthDist, shared_prefix_workload
from baton_serve.cluster.cli import main


def test_one_warm_up_per_prefix_shares_the_prefix_and_nothing_more(real_tok):
    specs = shared_prefix_workload(12, 3, prefix_len=16, suffix_len=LengthDist(6), output_len=LengthDist(2),
                                   seed=4)
    factory = PromptFactory(real_tok, seed=4)
    prompts = factory.build(specs)
    warm = factory.prefix_warmups(specs, prompts)
    assert [s.prefix_group for s, _ in warm] == list(dict.fromkeys(s.prefix_group for s in specs))
    for spec, prompt in warm:
        first = next(p for s, p in zip(specs, prompts) if s.prefix_group == spec.prefix_group)
        assert prompt.token_ids[:16] == first.token_ids[:16] and prompt.num_tokens == first.num_tokens
        # the suffix is fresh: no measured prompt begins with a warm-up's whole prompt
        assert all(p.token_ids[16:] != prompt.token_ids[16:] for p in prompts)
    # the measured prompts do not depend on whether warm-ups are built after them
    assert [p.token_ids for p in PromptFactory(real_tok, seed=4).build(specs)] == [p.token_ids for p in prompts]


def _bench(server, out, *extra: str) -> int:
    return main(["bench", "--base-url", server.url, "--disable-tqdm", "--request-timeout", "30",
                 "--endpoint", "/v1/chat/completions", "--dataset-name", "shared-prefix",
                 "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-prefix-len", "8",
                 "--prefix-repetition-suffix-len", "4", "--prefix-repetition-output-len", "2",
                 "--num-prompts", "9", "--num-warmups", "0", "--no-plot", "--result-file", str(out), *extra])


def test_the_server_sees_each_prefix_once_more_first_and_the_run_is_unchanged(tmp_path):
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.01, itl_s=0.002)) as server:
        assert _bench(server, tmp_path / "plain.json") == 0
        plain = list(server.bodies)
        assert _bench(server, tmp_path / "warm.json", "--warmup-prefixes") == 0
        warm = server.bodies[len(plain):]
    assert len(warm) == len(plain) + 3
    first_three = [b["messages"][0]["content"] for b in warm[:3]]
    assert len(set(first_three)) == 3  # one per system prompt, before any measured request
    # the measured requests are the very same ones, and no warm-up is one of them
    assert sorted(json.dumps(b["messages"]) for b in warm[3:]) == sorted(json.dumps(b["messages"]) for b in plain)
    assert not {json.dumps(b["messages"]) for b in warm[:3]} & {json.dumps(b["messages"]) for b in plain}
    assert set(first_three) == {b["messages"][0]["content"] for b in plain}
    data = json.loads((tmp_path / "warm.json").read_text())
    assert data["config"]["warmup_prefixes"] is True and data["completed"] == 9


def test_warm_up_of_prefixes_without_shared_prefixes_is_refused(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--warmup-prefixes"]) == 2
    err = capsys.readouterr().err
    assert "--warmup-prefixes needs --dataset-name shared-prefix" in err and "Traceback" not in err
