"""The farm's core: what a tuning job is made of, with no storage, cluster or user interface.

Errors, measurement results, config spaces, targets, workloads, tasks, schedule templates,
cost-model features, search strategies, the cost model itself and job specs. Every other
layer (`db`, `workers`, `scheduler`, the user-facing modules of `farm`) imports from here;
nothing here imports from them (tests/test_layers.py checks it).
"""
