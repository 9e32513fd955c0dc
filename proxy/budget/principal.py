"""Whom a request is counted against: the user (and key, and team) and the limits that hold them.

A budget's value, made by proxy.auth from a client's key: the budget plans by it (`Budget.plan`)
and the ledger's rows name it, neither needing to know how a key was checked. It holds what
admission needs and no more: what capture and the tags read of a caller is in
proxy.config.callers.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.budget.clamp import WORST_CASE, AdmissionRule
from proxy.budget.limits import EffectiveLimits


@dataclass(frozen=True, slots=True)
class Principal:
    user: str
    limits: EffectiveLimits
    key_id: str | None = None  # first 12 hex digits of the key's hash: safe to log
    key_name: str | None = None
    team: str | None = None
    enforce: bool = True  # False: metered only (open and pass-through modes)
    forward_client_key: bool = False  # pass-through: the client's key is the upstream key
    # How a request whose worst case does not fit is treated: key > user > team > defaults.
    admission: AdmissionRule = WORST_CASE
