"""pdserve's gRPC API: ``pdserve.proto``, its generated modules and a small client.

The generated ``pdserve_pb2*.py`` files are committed; regenerate them after editing the
proto with ``python -m pdserve.deployments.grpc.regenerate`` (grpcio-tools), which makes the
generated code import ``pdserve.deployments.grpc.pdserve_pb2`` (not a top-level
``pdserve_pb2``). The proto package is ``pdserve.v1``.

Serve's gRPC proxy registers the service with
``grpc_servicer_functions=["pdserve.deployments.grpc.pdserve_pb2_grpc.add_PDServeServicer_to_server"]``.
"""
