"""Verification: candidates run for real on the device, under the budget.

* ``_verifier``: ``Verifier``, one configuration measured (peak and throughput).
* ``_winner``: which candidates to run, which one wins, timing close contenders again.
* ``_ladder``: the fallback ladder, verified the same way.
* ``_studies``: a tuning run kept in an Optuna storage, to resume or share it.

Nothing is re-exported here: importing one module loads only what it needs.
"""
