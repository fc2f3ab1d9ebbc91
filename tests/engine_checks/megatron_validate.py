"""Run Megatron-LM's own parse_args and validate_args (and the TransformerConfig and pipeline
layout checks they lead to) on an exported launch script read from stdin.

    PYTHONPATH=/path/to/Megatron-LM python tests/engine_checks/megatron_validate.py WORLD_SIZE < job.sh

Prints ACCEPTED on success; Megatron-LM's assertion otherwise. The data, tokenizer and
optimizer arguments a user adds are stood in by mock data, a null tokenizer and a fixed
iteration count. Without a GPU the compute capability is taken to be 9 (Hopper), where the
most rules apply, and Transformer Engine's fused RoPE (absent on CPU) is switched off.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from autoplan.megatron_rules import parse_script  # noqa: E402


def main() -> None:
    argv, env = parse_script(sys.stdin.read())
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ["WORLD_SIZE"] = sys.argv[1]
    import torch

    import megatron.core.utils as core_utils
    import megatron.training.arguments as arguments
    if not torch.cuda.is_available():
        arguments.get_device_arch_version = core_utils.get_device_arch_version = lambda: 9
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)   # --moe-grouped-gemm asks
        argv.append("--no-rope-fusion")
    extra = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", "10", "--lr", "1e-4"]
    if "--vocab-size" not in argv:
        extra += ["--vocab-size", "32000"]
    if "--num-layers" not in argv:
        extra += ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
                  "--max-position-embeddings", "1024", "--seq-length", "1024"]
    sys.argv = ["pretrain_gpt.py"] + argv + extra
    args = arguments.parse_args()
    arguments.validate_args(args, {})
    config = arguments.core_transformer_config_from_args(args)
    if config.pipeline_model_parallel_layout is not None:
        config.pipeline_model_parallel_layout.validate_layer_layout(args.num_layers, args.mtp_num_layers)
    print("ACCEPTED", "dp", args.data_parallel_size, "vpp", args.virtual_pipeline_model_parallel_size)


if __name__ == "__main__":
    main()
