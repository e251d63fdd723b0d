"""A deployment that opens its own Ray session names its actors in its namespace (default "baton"),
so operators and tests find them with Ray's own API."""

from __future__ import annotations

from baton_serve.cluster.config import ClusterConfig


def test_workers_controller_and_fronts_are_named_in_the_deployments_namespace(tiny_model_dir):
    import ray
    from baton_serve.cluster.http_actor import start_fronts, stop_fronts
    from baton_serve.cluster.launcher import Cluster
    from baton_serve.router.server import bind_socket

    if ray.is_initialized():  # another module's session: this deployment must open its own
        ray.shutdown()
    config = ClusterConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": 32},
        "pools": {"prefill": 1, "decode": 1}, "server": {"model_name": "tiny"}, "ray": {"num_cpus": 2}})
    probe = bind_socket("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    cluster = Cluster(config)
    fronts = []
    try:
        cluster.start()
        assert cluster.named
        fronts = start_fronts(cluster, 1, "127.0.0.1", port, "tiny", 16)
        for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            assert ray.get(ray.get_actor(name, namespace="baton").info.remote())["role"] == role
        snapshot = ray.get(ray.get_actor("controller", namespace="baton").snapshot.remote())
        assert set(snapshot["members"]) == {"prefill-0", "decode-0"}
        assert ray.get(ray.get_actor("front-0", namespace="baton").url.remote()) == f"http://127.0.0.1:{port}"
        try:
            cluster.actor_name("decode-0")
        except RuntimeError as exc:  # a second deployment in the namespace is told to take its own
            assert "[ray] namespace" in str(exc)
        else:
            raise AssertionError("a taken name was handed out again")
    finally:
        stop_fronts(fronts)
        cluster.stop()
    assert not ray.is_initialized()  # the session it opened, it closed
