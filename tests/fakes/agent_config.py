"""An agent's configuration for tests that run one agent over fakes (a memory
store, fake workers): node "a" of job "j", one node, two workers, nothing on disk."""

from __future__ import annotations

from typing import Any

from agent.config import AgentConfig


def one_node_config(**overrides: Any) -> AgentConfig:
    """The configuration, with ``overrides`` (AgentConfig's field names) applied."""
    fields: dict[str, Any] = dict(
        job_id="j", etcd="mem", standalone=False, min_nodes=1, max_nodes=1,
        nproc_per_node=2, node_id="a", max_restarts=3, restart_window_s=3600.0,
        checkpoint_dir=None, hang_timeout_s=30.0, lease_ttl_s=3.0, settle_s=0.0,
        join_timeout_s=600.0, start_timeout_s=60.0, exit_barrier_timeout_s=300.0,
        scale_up_wait_s=0.0, listen="mem:0", advertise_addr="h", state_dir="/nonexistent",
        log_dir="/nonexistent", log_format="text", metrics_port=0, stop_grace_s=1.0,
        drain_exit_code=0, prestart=False, warm_sets=1, connect_timeout_s=1.0,
        script="train.py", module=None, script_args=())
    fields.update(overrides)
    return AgentConfig(**fields)
