"""pdserve's gRPC API: ``pdserve.proto``, its generated modules and a small client.

The generated ``pdserve_pb2*.py`` files are committed. Regenerate them from the repository
root so that the generated code imports ``pdserve.deployments.grpc.pdserve_pb2`` (not a top-level
``pdserve_pb2``)::

    python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \\
        deployments/grpc/pdserve.proto

Serve's gRPC proxy registers the service with
``grpc_servicer_functions=["pdserve.deployments.grpc.pdserve_pb2_grpc.add_PDServeServicer_to_server"]``.
"""
