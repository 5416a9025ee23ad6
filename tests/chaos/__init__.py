"""Chaos campaign: real elasticd agents, a 3-member etcd and network namespaces, seeded faults.

    python -m tests.chaos --seed 7 --faults 16 [--variant fixed|elastic|memory]
    make chaos SEED=7 FAULTS=16
    pytest -m chaos tests/chaos

Modules: :mod:`~tests.chaos.topology` (namespaces, bridge, cuts, delay/loss,
the checkpoint tmpfs), :mod:`~tests.chaos.etcd_cluster` (3 members),
:mod:`~tests.chaos.cluster` (agents, step logs, checkpoint poller, events),
:mod:`~tests.chaos.faults` (one function per fault kind),
:mod:`~tests.chaos.invariants` (pure checks),
:mod:`~tests.chaos.campaign` (the run), ``train.py`` (the workers' script),
:mod:`~tests.chaos.impair` (userspace delay/loss where tc netem is missing).
"""

from elastic.net import no_grpc_fork_handlers

# The harness forks (with preexec_fn) while its own etcd client runs.
no_grpc_fork_handlers()
