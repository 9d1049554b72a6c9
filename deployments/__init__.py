"""pdserve on Ray Serve: ingress, prefill and decode servers, routers, autoscaling, app builder.

Import submodules directly (``pdserve.deployments.config``, ``pdserve.deployments.messages``,
``pdserve.deployments.app``...). This package module stays import-light: the config and the typed
messages must be importable without Ray, torch or the engine (the CLI, the Helm tests and
the ingress validate configs and build requests with nothing else loaded).
"""
