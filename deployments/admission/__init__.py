"""Overload control, one owner per side.

- ``rules``: the pure rules (TTFT prediction from the queue ahead, admit or shed, the
  drain time a shed reports, the calibration and the pending-prefill books);
- ``decode``: ``DecodeAdmission``, a decode replica's admission (``DecodeServer`` and the
  simulator run it);
- ``front_door``: ``FrontDoor``, what an ingress replica sheds before any work;
- ``signals`` (the door's overload signals) and ``stream_limit`` (its adaptive bound on
  open streams).

This package imports neither Ray nor torch.
"""
