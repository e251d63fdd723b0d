"""A resumed sample (request migration) continues exactly where the undisturbed one would be."""

from __future__ import annotations

import re

import pytest
from baton_serve.workers import LLM, SamplingParams
from baton_serve.workers.engine.request import SampleResume
from baton_serve.workers.errors import InvalidRequestError
from hypothesis import given, settings
from hypothesis import strategies as st

NUM_BLOCKS = 96
PROMPT = [3, 17, 29, 5, 71, 8, 44, 12, 9, 60, 2]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS,
               max_num_batched_tokens=64)


def _run(engine, request_id, prompt, params, resume=None) -> dict[int, list[int]]:
    engine.add_request(request_id, prompt, params, resume=resume)
    out: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.index, []).extend(d.token_ids)
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS  # nothing leaked by either path
    return out


PARAMS = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, top_p=0.9, seed=1234),
    "penalised": dict(temperature=0.8, seed=7, frequency_penalty=0.5, presence_penalty=0.3,
                      repetition_penalty=1.2, min_tokens=14),
}


@pytest.mark.parametrize("kind", sorted(PARAMS))
@pytest.mark.parametrize("cut", [1, 5, 13])
def test_resumed_sample_continues_the_undisturbed_stream(llm, kind, cut):
    whole = _run(llm.engine, f"whole-{kind}-{cut}", PROMPT,
                 SamplingParams(max_tokens=16, ignore_eos=True, **PARAMS[kind]))[0]
    rest = _run(llm.engine, f"rest-{kind}-{cut}", PROMPT,
                SamplingParams(max_tokens=16, ignore_eos=True, **PARAMS[kind]),
                resume=SampleResume(0, whole[:cut]))[0]
    assert whole[:cut] + rest == whole


@settings(max_examples=8, deadline=None)
@given(index=st.integers(0, 2), cut=st.integers(1, 9))
def test_any_sample_of_n_resumes_on_its_own(llm, index, cut):
    """Sample ``index`` of an n = 3 request, resubmitted alone with n = 1 and its index, draws from
    its own seeded stream: the same continuation as inside the undisturbed group."""
    group = _run(llm.engine, f"group-{index}-{cut}", PROMPT,
                 SamplingParams(n=3, max_tokens=10, ignore_eos=True, temperature=1.0, seed=99))
    rest = _run(llm.engine, f"alone-{index}-{cut}", PROMPT,
                SamplingParams(n=1, max_tokens=10, ignore_eos=True, temperature=1.0, seed=99),
                resume=SampleResume(index, group[index][:cut]))
    assert list(rest) == [index]
    assert group[index][:cut] + rest[index] == group[index]


def test_a_resume_that_cannot_continue_is_refused_with_nothing_queued(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad-n", PROMPT, SamplingParams(n=2, max_tokens=8), resume=SampleResume(0, [1]))
    assert info.value.param == "n"
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("full", PROMPT, SamplingParams(max_tokens=3), resume=SampleResume(0, [1, 2, 3]))
    assert info.value.param == "max_tokens"
    assert not engine.has_unfinished_requests() and "bad-n" not in engine.groups and "full" not in engine.groups


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("where", ["first", "middle"])
def test_a_constrained_sample_resumes_inside_its_grammar(llm, kind, where):
    """A migrated constrained sample: its matcher is rebuilt from the emitted tokens, so the rest
    is what the undisturbed run wrote (and still follows the grammar)."""
    from baton_serve.workers.sampling.structured.spec import StructuredSpec

    pattern = "(ab|c[de]){8,14}!"
    spec = StructuredSpec.regex(pattern).to_dict()

    def params():
        return SamplingParams(max_tokens=24, structured_outputs=spec, **PARAMS[kind])

    whole = _run(llm.engine, f"cwhole-{kind}-{where}", PROMPT, params())[0]
    cut = 1 if where == "first" else len(whole) // 2
    assert 0 < cut < len(whole)
    rest = _run(llm.engine, f"crest-{kind}-{where}", PROMPT, params(), resume=SampleResume(0, whole[:cut]))[0]
    assert whole[:cut] + rest == whole
    assert re.fullmatch(pattern, llm.tokenizer.decode(whole)), llm.tokenizer.decode(whole)
