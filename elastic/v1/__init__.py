"""Generated gRPC code of the agent's services (package ``elastic.v1``).

The ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` modules here are generated
by ``make protos`` (``tools/gen_protos.py``) from ``protos/elastic/v1``. Do not
edit them: change the ``.proto`` and regenerate; ``tests/unit/test_protos_fresh.py``
fails when they are stale.
"""
