"""The body of ranks 1..N-1 of a tensor-parallel replica: join the group, load this rank's shard,
then run rank 0's step plans on it until rank 0 closes the channel.

These ranks schedule nothing and sample nothing: rank 0 owns the scheduler, the block manager
and the sampler, and its plan says which slots every rank writes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from baton_serve.kernels.kernel_choice import Workload
from baton_serve.workers.engine.model_runner import ModelRunner
from baton_serve.workers.engine.step_plan import StepPlan
from baton_serve.workers.errors import TensorParallelError
from baton_serve.workers.kv.pair_group import local_ip_towards
from baton_serve.workers.model.layers import ParallelContext
from baton_serve.workers.model.loader import load_model, parse_dtype
from baton_serve.workers.parallel.group import TPGroup, TPRendezvous
from baton_serve.workers.parallel.kv_agent import KVAgent, serve_agent
from baton_serve.workers.parallel.plan_channel import PlanReceiver

log = logging.getLogger("baton.tp")


@dataclass
class RankSpec:
    """What a rank other than 0 needs to build its shard; plain fields (it crosses processes)."""

    rendezvous: dict[str, Any]
    rank: int
    model_folder: str
    dtype: str
    device: str = "cpu"
    max_positions: int | None = None
    deterministic: bool = False
    num_threads: int | None = None
    decode_rows: int = 32  # the rows its CPU kernel choice is measured at (kernels.kernel_choice)
    prefill_rows: int = 2048


def runner_setup(num_blocks: int, block_size: int, num_host_blocks: int) -> bytes:
    """Rank 0's first message: how large a cache every rank allocates."""
    return msgpack.packb([num_blocks, block_size, num_host_blocks])


def serve_rank(spec: RankSpec) -> int:
    """Run one rank until rank 0 closes its channel; returns the number of plans it ran."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    rdv = TPRendezvous(**spec.rendezvous)
    receiver = PlanReceiver(rdv.host, rdv.plan_port, spec.rank, rdv.secret, rdv.timeout_s)
    group = TPGroup(rdv, spec.rank, spec.device)
    steps = 0
    try:
        ctx = ParallelContext(rdv.world_size, spec.rank, group)
        model = load_model(spec.model_folder, dtype=parse_dtype(spec.dtype), ctx=ctx,
                           max_positions=spec.max_positions, device=spec.device,
                           deterministic=spec.deterministic,
                           workload=Workload(spec.decode_rows, spec.prefill_rows))
        setup = receiver.recv()
        if setup is None:
            return 0
        num_blocks, block_size, num_host_blocks = msgpack.unpackb(setup)
        runner = ModelRunner(model, num_blocks, block_size, spec.device, num_host_blocks=num_host_blocks)
        # Its part of KV shipments to and from other replicas, driven by rank 0 (kv_agent).
        agent = KVAgent(runner.kv_caches, block_size, spec.device, local_ip_towards(rdv.host, rdv.store_port))
        serve_agent(agent, rdv.host, rdv.kv_port, spec.rank, rdv.secret, rdv.timeout_s)
        while (frame := receiver.recv()) is not None:
            runner.run(StepPlan.decode(frame), logits=False)
            steps += 1
    except TensorParallelError as exc:  # rank 0 or a peer died mid-step: this replica is over
        log.warning("tensor-parallel rank %d stops: %s", spec.rank, exc)
    finally:
        group.close()
        receiver.close()
    return steps


def main(argv: list[str]) -> int:
    """``python -m baton_serve.workers.parallel.rank '<RankSpec as JSON>'`` (``ProcessRanks``)."""
    import json

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve_rank(RankSpec(**json.loads(argv[1])))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv))
