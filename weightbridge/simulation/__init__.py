"""The transfer simulator: what a plan's rounds should take on a described cluster.

`simulate.simulate` estimates a plan's end-to-end time (EWTT) against Eq. (1)
(`weightbridge.planning.ideal.eq1`) on a `simulate.Cluster`; `timeline` replays the rounds step
by step over a `fluid` model of shared links, with per-step overheads fitted by `calibrate`
from measured runs. Used by the benchmarks and docs/planning.md; no driver needs it.
"""
