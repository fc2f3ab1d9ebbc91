"""Shared test settings."""
import torch

# Tests share two cores with spawned gloo ranks; one intra-op thread per process keeps
# them from oversubscribing the machine (and keeps float reductions deterministic).
torch.set_num_threads(1)
