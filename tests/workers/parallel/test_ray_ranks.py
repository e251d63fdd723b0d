"""Ranks 1..N-1 in Ray actors (``distributed_executor_backend = "ray"``, what cluster workers use):
the same greedy text as TP=1, and the actors gone after shutdown."""

from __future__ import annotations

from pathlib import Path

import pytest
from baton_serve.workers.llm import LLM
from baton_serve.workers.sampling.params import SamplingParams

from tests.tiny_model import write_tiny_llama

ray = pytest.importorskip("ray")


def test_ray_ranks_give_the_text_of_one_rank(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m", num_heads=4, num_kv_heads=2, seed=5)
    prompts = [[5, 6, 7, 8] * 6, list(range(30, 70))]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    one = LLM(model=str(model), dtype="float32", num_threads=1)
    want = [list(o.outputs[0].token_ids) for o in one.generate(prompts, greedy)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(model=str(model), dtype="float32", num_threads=1, tensor_parallel_size=2,
                  distributed_executor_backend="ray")
        try:
            actors = list(llm.engine.tensor_parallel.ranks.actors)
            assert len(actors) == 1
            assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == want
        finally:
            llm.shutdown()
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actors[0].pid.remote(), timeout=30)
    finally:
        ray.shutdown()
