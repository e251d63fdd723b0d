"""cluster.metrics_merge: a front's scrape with the other fronts' per-front share added."""

from __future__ import annotations

from baton_serve.cluster.metrics import Metrics
from baton_serve.cluster.metrics_merge import merge_expositions
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


def _front(requests: int, ttft: float, worker_running: int) -> Metrics:
    m = Metrics("tiny")
    for _ in range(requests):
        m.observe_request(arrival=0.0, first_token=ttft, token_times=[ttft, ttft + 0.01], prompt_tokens=5,
                          output_tokens=2, finish_reason="stop")
    m.running.labels("decode", "decode-0").set(worker_running)
    return m


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_per_front_families_sum_and_mirrored_ones_stay_own():
    a, b, c = _front(3, 0.1, 4), _front(2, 0.3, 4), _front(0, 0.0, 5)
    merged = _samples(merge_expositions(generate_latest(a.registry),
                                        [generate_latest(b.registry), generate_latest(c.registry)], a.per_front))
    model = (("model_name", "tiny"),)
    assert merged["baton:request_success_total", (("finished_reason", "stop"), *model)] == 5
    assert merged["baton:time_to_first_token_seconds_count", model] == 5
    assert merged["baton:time_to_first_token_seconds_sum", model] == 3 * 0.1 + 2 * 0.3
    assert merged["baton:time_to_first_token_seconds_bucket", (("le", "0.25"), *model)] == 3
    assert merged["baton:prompt_tokens_total", model] == 25
    # the workers' state is what every front polls alike: this front's own view, not a sum
    assert merged["baton:num_requests_running", (("role", "decode"), ("worker", "decode-0"))] == 4
    created = [v for (name, labels), v in _samples(generate_latest(a.registry)).items()
               if name == "baton:prompt_tokens_created"]
    assert merged["baton:prompt_tokens_created", model] <= created[0]


def test_a_series_only_a_peer_has_is_added():
    a, b = Metrics("tiny"), Metrics("tiny")
    b.observe_rejected("queue_full", "acme")
    merged = _samples(merge_expositions(generate_latest(a.registry), [generate_latest(b.registry)], a.per_front))
    assert merged["baton:requests_rejected_total", (("model_name", "tiny"), ("reason", "queue_full"),
                                                    ("tenant", "acme"))] == 1


def test_no_peers_is_own_exposition():
    a = _front(1, 0.1, 1)
    own = generate_latest(a.registry)
    assert _samples(merge_expositions(own, [], a.per_front)) == _samples(own)
