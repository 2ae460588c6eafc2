"""Measure this machine for the planner: `hardware` (the hardware profile), `acceptance` (the acceptance table),
`allreduce` (tensor parallelism's all-reduce); `timing` and `machine` are what they measure with."""
