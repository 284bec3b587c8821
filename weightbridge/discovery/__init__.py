"""Layout discovery (paper section 2.1): what each worker's own ``load_weights`` does.

`probe.extract_source_map` feeds a worker's loader index-valued checkpoints (`codec`), reads
back which checkpoint element landed in each parameter element, recovers runs (`runs`) and
boxes (`boxes`) from them and returns a compact `weightbridge.types.SourceMap`; `replay` is
that map's meaning and the oracle the probe checks itself against; `diagnose` names the
checkpoint tensor behind a loader the probe refuses. `correspond` intersects a trainer's and
a rollout's maps in checkpoint coordinates. Nothing here moves weight bytes between workers.
"""
