"""pdserve's cluster simulator and capacity planner.

A discrete-event simulation of prefill and decode replica pools that routes, places and
autoscales requests with pdserve's own code (``pdserve.deployments``: routers, policy,
estimator, autoscaling policies), over engine cost models measured on this machine
(``pdserve.sim.profile``) or derived from GPU datasheets (``pdserve.sim.cost``). It never
imports torch and never starts Ray.
"""
