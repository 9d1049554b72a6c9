"""Topology and launch: node pools, labels, a local multi-node Ray cluster, the ``pdserve`` CLI.

``cluster`` sits on top of ``deployments``: it imports the app config and builder, never the
reverse. This package module stays import-light (no Ray, no torch) so ``pdserve --help`` and
``pdserve down`` answer quickly.
"""
