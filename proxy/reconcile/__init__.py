"""Do the books and the budget store tell the same story? `tokenmeter reconcile` (command.py),
its reading and verdicts (plan.py), what it prints (render.py), and the same reading run inside
the proxy every `ledger.reconcile_every_s` (audit.py).

A package of its own above `ledger` and `budget`, the one that reads both: the two stay
independent of each other, and the comparison of their numbers is said in one place.
"""
