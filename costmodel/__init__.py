"""The cost model: iteration time and per-rank memory of a plan (see costmodel.estimate)."""
from costmodel.estimate import Estimate, EstimateOptions, estimate, stage_costs

__all__ = ["Estimate", "EstimateOptions", "estimate", "stage_costs"]
