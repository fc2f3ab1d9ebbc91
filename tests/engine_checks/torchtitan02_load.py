"""Load torchtitan 0.2 TOML exports with torchtitan 0.2's own ConfigManager and ParallelDims.

    PYTHONPATH=DIR_WITH_TORCHTITAN_0_2 python tests/engine_checks/torchtitan02_load.py '[[file, world, tp, pp, stages], ...]'

Prints one ACCEPTED line per file."""
from __future__ import annotations

import json
import sys


def main() -> None:
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    for path, world, tp, pp, stages in json.loads(sys.argv[1]):
        c = ConfigManager().parse_args(["--job.config_file", path])
        p = c.parallelism
        dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                            ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world)
        assert (dims.tp, dims.pp) == (tp, pp)
        if pp > 1:
            assert len(p.module_fqns_per_model_part) == stages
        print("ACCEPTED", path)


if __name__ == "__main__":
    main()
