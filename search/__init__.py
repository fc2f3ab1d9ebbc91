"""Search of parallel plans: ``search(model, cluster, global_batch, **constraints)``.

Pipelines of device groups (CP-SAT placement on heterogeneous clusters), a DP that
splits layers over them for speed and memory, branch and bound on cheap analytic
bounds, and the full cost model to rank the shortlist. See ``docs/search.md``.
"""
from search.core import search
from search.result import RankedPlan, SearchResult, SearchStats
from search.space import Constraints

__all__ = ["search", "SearchResult", "RankedPlan", "SearchStats", "Constraints"]
