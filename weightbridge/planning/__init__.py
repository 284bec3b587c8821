"""Global planning (paper section 2.2): who sends which bytes to whom, in which round.

`plan.plan_transfer` turns the intersected source maps into a non-redundant, load-balanced,
three-stage `plan.TransferPlan` (receive, external exchange between rollout nodes, internal
exchange within a node); `route` builds its flat routing tables; `worker_plans` gives one
worker its copy descriptors and writes per round; `ideal.eq1` is the plan's Eq. (1) time (the
simulator, `weightbridge.simulation`, estimates its rounds'). Pure functions of value types: no
process, no tensor.
"""
