"""The node agent (elasticd) and the operator's CLI (elasticctl). Never imports torch."""

from elastic.net import no_grpc_fork_handlers

no_grpc_fork_handlers()  # before any module of the agent starts gRPC
