"""Generated gRPC code of etcd's v3 API (packages ``etcdserverpb``, ``mvccpb``, ``authpb``).

The ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` modules here are generated
by ``make protos`` (``tools/gen_protos.py``) from ``protos/elastic/store/etcdpb``,
etcd's ``.proto`` files vendored there (its README says from where). Do not edit
them: change the ``.proto`` and regenerate; ``tests/unit/test_protos_fresh.py``
fails when they are stale. Only the store's etcd backend (``elastic.store``)
speaks this API.
"""
