"""The node agent (elasticd) and the operator's CLI (elasticctl). Never imports torch."""

from elastic.net import no_grpc_fork_handlers, quiet_grpc_logs

# Before any module of the agent starts gRPC.
no_grpc_fork_handlers()
quiet_grpc_logs()
