"""Execution (paper section 2.3): one worker's bytes for one round of a plan.

`executor.WorkerExecutor` holds a worker's round buffers (``depth`` arenas), packs its
parameters into them and assembles what peers wrote; `boxcopy.CopyKernels` is the pack and
assemble interface, with `cpu_kernels` as the torch path and ``kernels/`` (Triton) on GPUs,
chosen from the parameters' device by `executor.default_kernels`. The writes themselves go
through a `weightbridge.coordination.control.Transport`.
"""
