"""The single accounting policy: every formula of docs/design.md §2, once, as pure functions over facts.

By concern: ``measures`` (exact, bound or absent), ``reservations`` (R(r) and the request
columns), ``physical`` (unique blocks), ``invariants``, ``engine_accounts`` (pools, tenants,
engines), ``device_budget`` (GPU memory terms), ``sizing`` (the planner).
Nothing here does I/O; nothing outside this package does accounting arithmetic.
"""
