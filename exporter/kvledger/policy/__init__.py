"""The single accounting policy: every formula of docs/design.md §2, once, as pure functions over facts.

By concern: ``reservations`` (R(r) and the request columns), ``physical`` (unique blocks),
``invariants``, ``engine_accounts`` (pools, tenants, engines), ``device_budget`` (GPU memory
terms), ``saturation`` (the ratios and the binding constraint), ``arithmetic`` (ceilings,
ratios and bounds). Nothing here does I/O; nothing outside this package does accounting
arithmetic (the planner, ``tools/plan``, sizes a deployment before it serves, with R(r) from here).
"""
