"""Pure planning, no I/O: which samples every (rank, worker) reads, in every pass of a run.

    topology.py  who we are (World), what a segment's topology is (Topology)
    mix.py       the one planner: a data epoch of a mix (plan_mix); a single dataset is a mix of one source
    epoch.py     plan_epoch / EpochPlan: a single dataset's plan, a view of plan_mix's
    shuffle.py   the shuffle as arithmetic (RNG streams, where a shuffle stood after k outputs)
    layout.py    a data epoch laid out over a topology: a worker's reads, what a pass left unconsumed
    state.py     the resume state (versioned JSON)          run.py  RunPlan: passes, resume, the one interface

Planning imports nothing above it (checked by `lint-imports`, see pyproject.toml).
"""
