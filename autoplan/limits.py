"""Sanity limits on the sizes a user can ask for.

Each limit is far above any system that exists or is planned, and low enough that
nothing autoplan does with a value at the limit runs for hours or exhausts memory
(a cluster's rank table, a schedule program's action lists, the search's layer-split
tables and divisor enumerations all grow with these). A value past a limit is refused
up front with a :class:`~autoplan.errors.ConfigError` naming the field, before any
work starts; ``test_fuzz_inputs`` and ``test_limits`` check that values *at* the
limits still finish quickly.
"""
from __future__ import annotations

MAX_GPUS = 65_536
"""Ranks in one cluster or plan (the largest training clusters have a few times 10^4)."""
MAX_GPUS_PER_NODE = 1_024
"""Accelerators in one node (an NVL72 rack counts 72)."""
MAX_NODE_GROUPS = 64
"""Node groups in one cluster.json (kinds of nodes; identical nodes share a group)."""
MAX_LAYERS = 1_024
"""Transformer blocks of one model (the deepest published LLMs have under 200)."""
MAX_UNITS = MAX_LAYERS + 2
"""Pipeline units of a model: its blocks plus embedding and head."""
MAX_HIDDEN = 262_144
"""Model width."""
MAX_HEADS = 16_384
"""Attention heads (query or key/value)."""
MAX_FFN = 4 * MAX_HIDDEN
"""MLP inner width."""
MAX_VOCAB = 16_777_216
"""Vocabulary size."""
MAX_SEQ_LEN = 4_194_304
"""Tokens per sample (4M; long-context training reaches 1M)."""
MAX_EXPERTS = 4_096
"""Experts per mixture-of-experts layer."""
MAX_GLOBAL_BATCH = 4_194_304
"""Samples per iteration."""
MAX_MICRO_BATCH = 65_536
"""Samples per micro-batch."""
MAX_MICRO_BATCHES = 65_536
"""Micro-batches per iteration on one data-parallel replica."""
MAX_VIRTUAL_STAGES = 64
"""Chunks per pipeline rank in an interleaved schedule."""
MAX_SCHEDULE_SLOTS = 65_536
"""Pipeline ranks x virtual stages x micro-batches: the size of the schedule program the
cost model simulates and the runtime executes (e.g. 64 stages x 1024 micro-batches;
simulating a program at this limit takes seconds, and time grows with it)."""
MAX_TOP_K = 1_000
"""Plans a search may be asked to show."""
MAX_STEPS = 100_000_000
"""Training steps of one run."""
MAX_UNIT_OPS = 1_000_000
"""Operators in one unit's captured graph (a transformer block has a few hundred)."""
MAX_UNIT_PARAMS = 100_000
"""Parameters of one unit named in a per-operator layout."""
MAX_OP_TENSORS = 4_096
"""Tensor arguments or outputs of one operator in a layout (aten operators have a handful)."""
